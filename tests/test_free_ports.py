from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rlfleet import processes
from rlfleet.processes import free_port, free_port_block


def ephemeral_range() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


class Scripted:
    """Stands in for the port picker's random source: offers `first` ports in order, then random ones."""

    def __init__(self, *first: int) -> None:
        self.first = list(first)
        self.fallback = processes._pick

    def randrange(self, start: int, stop: int) -> int:
        return self.first.pop(0) if self.first else self.fallback.randrange(start, stop)


def test_picked_ports_lie_outside_the_range_outgoing_connections_take() -> None:
    # A port in the ephemeral range can be taken by any outgoing connection between picking it and
    # the service binding it, which made a fleet's last service fail with "address already in use".
    taken_by_connections = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert not [port for port in ports if port in taken_by_connections]
    assert all(port >= 1024 for port in ports)


def test_no_port_is_handed_out_twice_even_when_free_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first = free_port()
    monkeypatch.setattr(processes, "_pick", Scripted(first))  # offered again first
    assert free_port() != first


def test_a_block_avoids_ports_handed_out_singly_and_ports_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    single = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        for port in range(single + 10, single + 1000):
            try:
                listener.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        listener.listen()
        busy = listener.getsockname()[1]
        monkeypatch.setattr(processes, "_pick", Scripted(single - 1, busy - 2))  # overlapping each in turn
        base = free_port_block(3)
    block = range(base, base + 3)
    assert single not in block
    assert busy not in block
    assert not [port for port in block if port in ephemeral_range()]


def test_without_room_outside_the_ephemeral_range_ports_come_from_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(processes, "_PORT_RANGE_FILE", wide)
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # free, as promised
    assert 1024 <= port <= 65535
