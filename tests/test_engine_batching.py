"""The batching benchmark's clients: a failed request ends the measurement instead of leaving its tokens out."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from engine_batching import run_clients  # noqa: E402


def serve(status: int) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"meta_info": {"completion_tokens": 4}}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def healthy() -> Iterator[str]:
    yield from serve(200)


@pytest.fixture
def failing() -> Iterator[str]:
    yield from serve(500)


def test_clients_count_the_tokens_of_every_answer(healthy: str) -> None:
    assert run_clients(healthy, clients=2, seconds=0.2, max_new_tokens=4) > 0


def test_a_failed_request_is_an_error_not_a_lower_figure(failing: str) -> None:
    with pytest.raises(RuntimeError, match="2 of 2 clients failed"):
        run_clients(failing, clients=2, seconds=0.2, max_new_tokens=4)
