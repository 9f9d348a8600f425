"""The local fleet's ports: chosen with --base-port or --free-ports, refused up front when one is in use,
and a health check that another process answers on the service's port does not count, nor one of a service
another process listens beside on one of its ports."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.processes import ServiceProcess, ServiceStartError, free_port, free_port_block, port_is_free

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    """Enough of a model for the launcher's own check; no service ever loads it in these tests."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket listening on a free port, as another fleet's service would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock


@pytest.fixture
def foreign_http_server() -> Iterator[int]:
    """An HTTP server of this test process answering 200 to everything, on a free port."""

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_a_base_port_lays_the_services_out_after_it() -> None:
    ports = FleetPorts.from_base(9000, engines=2)
    assert (ports.rollout, ports.reward, ports.trainer_http) == (9000, 9001, 9002)
    assert (ports.rollout_grpc, ports.trainer_grpc, ports.reward_grpc, ports.router) == (9003, 9004, 9005, 9006)
    assert ports.engine_base == 9007
    with pytest.raises(ValueError, match="ports 65530-65538"):
        FleetPorts.from_base(65530, engines=2)


def test_up_refuses_a_port_in_use_before_starting_anything(
    tmp_path: Path, fake_model: Path, listener: socket.socket
) -> None:
    taken = listener.getsockname()[1]
    base = taken - 6  # the router's place in the layout
    state_dir = tmp_path / "state"
    started = time.monotonic()
    up = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "up", "--base-port", str(base), "--engines", "1"]
        + ["--model-path", str(fake_model), "--state-dir", str(state_dir), "--redis-url", REDIS_URL]
        + ["--redis-prefix", f"rlfleet-test:{uuid.uuid4().hex}:"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 1, up.stdout + up.stderr
    assert f"{taken} (router)" in up.stderr and "--base-port" in up.stderr and "--free-ports" in up.stderr
    assert "fleet is up" not in up.stdout
    # Nothing started (Redis answers, so none is started either), nothing recorded.
    assert "started engine" not in up.stderr and "Redis" not in up.stderr
    assert not (state_dir / "fleet.json").exists()
    assert time.monotonic() - started < 30


def test_a_health_answer_from_another_process_on_the_port_does_not_count(
    tmp_path: Path, foreign_http_server: int
) -> None:
    # The child would bind the port and die of "address already in use"; meanwhile the other server answers.
    child = ServiceProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log")
    try:
        url = f"http://127.0.0.1:{foreign_http_server}/health"
        with pytest.raises(ServiceStartError, match=rf"port {foreign_http_server} answers, but not from sleeper"):
            child.wait_healthy(url, timeout=10, port=foreign_http_server)
    finally:
        child.stop(timeout=5)


def test_a_health_answer_from_the_child_counts(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    child = ServiceProcess("web", argv, tmp_path / "web.log")
    try:
        child.wait_healthy(f"http://127.0.0.1:{port}/", timeout=20, port=port)
    finally:
        child.stop(timeout=5)


def test_a_port_whose_closed_connections_linger_is_free() -> None:
    # Right after `rlfleet down`, the server side of its last connections sits in TIME_WAIT; the services bind
    # with SO_REUSEADDR, so `rlfleet up` at once must not call their ports taken.
    port = free_port_block(1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server closes first: its side of the connection enters TIME_WAIT
        time.sleep(0.1)
        client.close()
    assert port_is_free(port)


GRPC_THEN_HTTP = """
import http.server, pathlib, sys, time
from concurrent import futures
import grpc
http_port, grpc_port, go = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
server = grpc.server(futures.ThreadPoolExecutor(1))  # grpc's defaults, as the services' servers
assert server.add_insecure_port(f"127.0.0.1:{grpc_port}") == grpc_port
server.start()
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")
http.server.HTTPServer(("127.0.0.1", http_port), Ok).serve_forever()
"""


def test_a_grpc_port_another_server_took_after_the_check_fails_the_start(tmp_path: Path, fake_model: Path) -> None:
    """gRPC binds with SO_REUSEPORT: a second server on the port binds without an error and gets part of the
    connections. A trainer whose gRPC port another process took between the port check and its bind was counted
    healthy, its HTTP port alone being checked."""
    fleet = LocalFleet(FleetConfig(model_path=fake_model, state_dir=tmp_path / "state"))
    http_port, grpc_port = free_port(), free_port()
    go = tmp_path / "go"
    argv = [sys.executable, "-c", GRPC_THEN_HTTP, str(http_port), str(grpc_port), str(go)]
    other = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        health = f"http://127.0.0.1:{http_port}/health"
        fleet._spawn("trainer", argv, health, {http_port: "trainer HTTP", grpc_port: "trainer gRPC"})
        assert other.add_insecure_port(f"127.0.0.1:{grpc_port}") == grpc_port  # taken after the check
        other.start()
        go.write_text("")
        trainer = fleet.processes["trainer"].pid
        with pytest.raises(
            ServiceStartError, match=rf"^{os.getpid()} listens on port {grpc_port} beside trainer \(pid {trainer}\)"
        ):
            fleet._wait("trainer")
    finally:
        other.stop(None)
        fleet.stop()
