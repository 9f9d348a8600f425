"""Every service's HTTP protocol bounds a request's head: past MAX_HEAD_BYTES, 431 and the connection closed,
whatever the token or body limits behind it would say; bodies and heads under the bound are served as before."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from rlfleet.http_head_limit import MAX_HEAD_BYTES, HeadLimitedHttpProtocol


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"body": len(await request.body()), "headers": len(request.headers)}

    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, http=HeadLimitedHttpProtocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield listener.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


def request(body: bytes, header_bytes: int = 0) -> bytes:
    padding = f"x-padding: {'p' * header_bytes}\r\n" if header_bytes else ""
    return f"POST /echo HTTP/1.1\r\nhost: t\r\n{padding}content-length: {len(body)}\r\n\r\n".encode() + body


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_head_past_the_bound_is_refused_with_431_as_it_arrives(port: int) -> None:
    """A 256 MiB header was gathered whole before anything looked at it: half a gigabyte of the service's memory.

    The head sent never ends, so only a server that refuses it as it arrives answers before read_all's timeout.
    It is one byte past the bound, all of which the server reads before it closes: unread bytes would make the
    close a reset, which may discard the answer before the client reads it."""
    start = b"POST /echo HTTP/1.1\r\nhost: t\r\nx-padding: "
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(start + b"p" * (MAX_HEAD_BYTES + 1 - len(start)))
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert answer.endswith(f"over {MAX_HEAD_BYTES} bytes".encode() + b'", "code": 431}}'), answer


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """`count` answers (status, body) on a keep-alive connection."""
    sock.settimeout(10)
    data, answers = b"", list[tuple[int, bytes]]()
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(answers)} answers"
            data += chunk
        head, data = data.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(data) < length:
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-answer"
            data += chunk
        answers.append((int(head.split()[1]), data[:length]))
        data = data[length:]
    return answers


def test_heads_under_the_bound_and_bodies_of_any_size_are_served(port: int) -> None:
    big_body = b"b" * (4 * MAX_HEAD_BYTES)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        # Pipelined: a small request, a large head under the bound, then a large body after a head that ends
        # inside the same write: none of the body counts as head, nor of the next head.
        sock.sendall(request(b"{}") + request(b"x", MAX_HEAD_BYTES - 200) + request(big_body) + request(b"", 10))
        answers = read_answers(sock, 4)
    assert [status for status, _ in answers] == [200] * 4, answers
    assert [json.loads(body)["body"] for _, body in answers] == [2, 1, len(big_body), 0]


def test_a_body_sent_after_its_head_in_another_write_is_not_counted(port: int) -> None:
    body = b"b" * (4 * MAX_HEAD_BYTES)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request(body)[: -len(body)])
        time.sleep(0.1)
        for start in range(0, len(body), 4096):
            sock.sendall(body[start : start + 4096])
        [(status, answer)] = read_answers(sock, 1)
    assert (status, json.loads(answer)["body"]) == (200, len(body))
