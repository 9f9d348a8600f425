from __future__ import annotations

import asyncio
import socket

import pytest

from rlfleet_reward.http_listener import tcp_listener


def test_accepted_connections_have_nagle_off() -> None:
    # With Nagle on, each keep-alive response waits ~40 ms for the client's delayed ACK.
    async def main() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = tcp_listener("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=listener)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


async def _round_trip(listener: socket.socket, connect_host: str) -> bytes:
    """Bytes sent from a client on `connect_host` to `listener`, echoed back."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, sock=listener)
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(connect_host, listener.getsockname()[1])
            writer.write(b"ping")
            echoed = await reader.readexactly(4)
            writer.close()
            return echoed
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1) to bind")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_binds_ipv6(host: str) -> None:
    listener = tcp_listener(host, 0)
    assert listener.family == socket.AF_INET6
    assert asyncio.run(_round_trip(listener, "::1")) == b"ping"


@pytest.mark.skipif(
    not (_ipv6_loopback() and socket.has_dualstack_ipv6()), reason="this machine cannot take IPv4 on an IPv6 socket"
)
def test_the_ipv6_wildcard_also_takes_ipv4_connections() -> None:
    listener = tcp_listener("::", 0)
    assert listener.family == socket.AF_INET6
    assert asyncio.run(_round_trip(listener, "127.0.0.1")) == b"ping"
