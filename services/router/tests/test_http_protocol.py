"""The router's HTTP/1.1 protocol: generation requests served from the parser, everything else by uvicorn."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from router_fakes import FakeEngine, RunningRouter, metric_value

from rlfleet.http_head_limit import MAX_HEAD_BYTES
from rlfleet_router import http_protocol


def post(path: str, body: dict[str, object], extra: str = "") -> bytes:
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\n{extra}\r\n"
    )
    return head.encode() + raw


def read_answers(sock: socket.socket, count: int, timeout: float = 10.0) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` HTTP/1.1 answers with content-length, in the order they arrive on `sock`."""
    sock.settimeout(timeout)
    data = b""
    answers: list[tuple[int, dict[str, str], bytes]] = []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(answers)} answers"
            data += chunk
        head, data = data.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers["content-length"])
        while len(data) < length:
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-answer"
            data += chunk
        answers.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return answers


@pytest.fixture
def one_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> tuple[FakeEngine, RunningRouter]:
    """A fake engine and a router in front of it, the engine healthy in routing."""
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    return engine, router


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The routes of the generation requests served from the parser (not through the ASGI app)."""
    routes: list[str] = []
    made = http_protocol.GenerationExchange.__init__

    def counting(self: http_protocol.GenerationExchange, *args: object, **kwargs: object) -> None:
        made(self, *args, **kwargs)  # type: ignore[arg-type]
        routes.append(self.route)

    monkeypatch.setattr(http_protocol.GenerationExchange, "__init__", counting)
    return routes


def test_generation_requests_skip_asgi_and_keep_the_connection(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    engine, router = one_engine
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        for k in range(3):  # one after another on one keep-alive connection
            sock.sendall(post("/generate", {"text": f"q{k}"}))
            [(status, headers, body)] = read_answers(sock, 1)
            assert status == 200 and json.loads(body)["meta_info"]["engine"] == "a"
            assert headers["x-rlfleet-engine"] == engine.url and "date" in headers
    assert served == ["/generate"] * 3
    assert [json.loads(raw)["text"] for raw in engine.raw_bodies] == ["q0", "q1", "q2"]
    metrics = router.client.get("/metrics").text
    assert metric_value(metrics, "rlfleet_router_requests_total", {"route": "/generate", "status": "200"}) == 3


def test_pipelined_requests_are_answered_in_order(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    engine, router = one_engine
    slow_first = post("/generate", {"text": "first", "delay": 0.3})
    then_info = b"GET /workers HTTP/1.1\r\nhost: r\r\n\r\n"
    then_generate = post("/generate", {"text": "third"})
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.sendall(slow_first + then_info + then_generate)  # all three before any answer
        answers = read_answers(sock, 3)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert json.loads(answers[1][2])["workers"][0]["url"] == engine.url
    assert [json.loads(raw)["text"] for raw in engine.raw_bodies] == ["first", "third"]
    assert served == ["/generate"]  # the third waited behind the second, on uvicorn's path


def test_a_client_gone_before_its_body_is_counted_and_the_router_serves_on(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    engine, router = one_engine
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.sendall(post("/generate", {"text": "never whole"})[:-5])
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    labels = {"route": "/generate", "status": "499"}
    while metric_value(router.client.get("/metrics").text, "rlfleet_router_requests_total", labels) != 1:
        assert time.monotonic() < deadline, "the abandoned request was not counted"
        time.sleep(0.05)
    assert engine.raw_bodies == [] and served == ["/generate"]
    assert router.client.post("/generate", json={"text": "next"}).status_code == 200


def test_expect_100_continue_takes_uvicorns_path(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    engine, router = one_engine
    request = post("/generate", {"text": "after continue"}, extra="expect: 100-continue\r\n")
    head, body = request.split(b"\r\n\r\n", 1)
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.sendall(head + b"\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        [(status, _, answer)] = read_answers(sock, 1)
    assert status == 200 and json.loads(answer)["meta_info"]["engine"] == "a"
    assert served == []


def test_a_body_larger_than_uvicorns_read_buffer_is_read_whole(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    engine, router = one_engine
    ids = list(range(40_000))  # ~230 KB of JSON: uvicorn pauses reading past 64 KB until the body is consumed
    response = router.client.post("/generate", json={"input_ids": ids}, timeout=10)
    assert response.status_code == 200, response.text
    assert json.loads(engine.raw_bodies[-1])["input_ids"] == ids
    assert served == ["/generate"]


@pytest.mark.parametrize("path", ["parser", "uvicorn"])
def test_a_client_leaving_a_stream_ends_the_engines_stream(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str], path: str
) -> None:
    """And asks the engine to abort it by rid, as a plain request's: the closed connection alone stops SGLang
    only when it next looks, and the stream went on generating for nobody."""
    engine, router = one_engine
    body = {"text": "long", "rid": "stream-left-1", "stream": True, "chunks": 200, "chunk_delay": 0.05}
    head, payload = post("/generate", body, extra="expect: 100-continue\r\n" if path == "uvicorn" else "").split(
        b"\r\n\r\n", 1
    )
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.settimeout(5)
        sock.sendall(head + b"\r\n\r\n")
        if path == "uvicorn":  # Expect: 100-continue takes uvicorn's path
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(payload)
        received = b""
        while received.count(b"data: ") < 2:  # the head and two events have arrived
            chunk = sock.recv(65536)
            assert chunk, "the stream ended early"
            received += chunk
    assert received.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in received
    deadline = time.monotonic() + 5
    labels = {"route": "/generate", "status": "499"}
    while (
        engine.streams_cut != 1
        or metric_value(router.client.get("/metrics").text, "rlfleet_router_requests_total", labels) != 1
    ):
        assert time.monotonic() < deadline, f"engine streams cut: {engine.streams_cut}; the router kept relaying"
        time.sleep(0.05)
    router.wait_for(lambda: engine.aborted() == ["stream-left-1"], timeout=3, what="the abort at the engine")
    assert served == (["/generate"] if path == "parser" else [])


@pytest.mark.parametrize("path", ["parser", "uvicorn"])
def test_a_client_leaving_a_plain_request_aborts_it_at_the_engine(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str], path: str
) -> None:
    engine, router = one_engine
    request = post("/generate", {"text": "long", "rid": "left-1", "delay": 20})
    if path == "uvicorn":  # Expect: 100-continue takes uvicorn's path
        request = post("/generate", {"text": "long", "rid": "left-1", "delay": 20}, extra="expect: 100-continue\r\n")
    head, body = request.split(b"\r\n\r\n", 1)
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.sendall(head + b"\r\n\r\n")
        if path == "uvicorn":
            sock.settimeout(5)
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        router.wait_for(lambda: engine.in_flight == 1, what="the request at the engine")
    # The engine stops generating (asked by rid) and the router's slot frees, long before the 20 s of generation.
    router.wait_for(lambda: engine.aborted() == ["left-1"] and engine.in_flight == 0, timeout=3, what="the abort")
    router.wait_for(lambda: router.workers()[0]["in_flight"] == 0, timeout=3, what="the router's slot released")
    labels = {"route": "/generate", "status": "499"}
    router.wait_for(
        lambda: metric_value(router.client.get("/metrics").text, "rlfleet_router_requests_total", labels) == 1,
        timeout=3,
        what="the request counted as its client's leaving",
    )
    assert served == (["/generate"] if path == "parser" else [])


def test_put_generate_is_served_as_post_and_other_methods_are_405(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    engine, router = one_engine
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.sendall(post("/generate", {"text": "put"}).replace(b"POST", b"PUT", 1))
        [(status, _, body)] = read_answers(sock, 1)
    assert status == 200 and json.loads(body)["meta_info"]["engine"] == "a"  # the fake engine takes POST only
    assert served == ["/generate"]
    for method, path, allowed in [
        ("GET", "/generate", "POST, PUT"),
        ("DELETE", "/generate", "POST, PUT"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("GET", "/v1/completions", "POST"),
    ]:
        answer = router.client.request(method, path, json={"text": "x"})
        assert answer.status_code == 405, (method, path, answer.text)
        assert answer.headers["allow"] == allowed and answer.json()["error"]["kind"] == "method_not_allowed"
    assert [json.loads(raw)["text"] for raw in engine.raw_bodies] == ["put"]


@pytest.mark.parametrize("path", ["parser", "uvicorn"])
def test_a_client_that_stops_reading_a_stream_is_cut_off_at_the_deadline(
    start_engine: Callable[..., FakeEngine],
    start_router: Callable[..., RunningRouter],
    served: list[str],
    path: str,
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], request_timeout_secs=2.0)
    router.wait_healthy(1)
    # ~6 MB/s for 4 s: by the deadline, more than the buffers between the engine and a client that reads nothing
    # hold, and the engine still streaming.
    body = {"text": "long", "rid": "stalled-1", "stream": True, "chunks": 400, "pad": 65536, "chunk_delay": 0.01}
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", router.server.port))
        extra = "expect: 100-continue\r\n" if path == "uvicorn" else ""
        head, raw = post("/generate", body, extra).split(b"\r\n\r\n", 1)
        sock.sendall(head + b"\r\n\r\n")
        if path == "uvicorn":
            sock.settimeout(5)
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(raw)
        router.wait_for(lambda: router.workers()[0]["in_flight"] == 1, what="the stream under way")
        # The client reads nothing: at the deadline the router gives the stream up, its engine's slot freed.
        router.wait_for(lambda: router.workers()[0]["in_flight"] == 0, timeout=6, what="the engine slot released")
        router.wait_for(lambda: engine.aborted() == ["stalled-1"], timeout=3, what="the abort at the engine")
        sock.settimeout(10)
        received = b""
        try:
            while chunk := sock.recv(1 << 20):
                received += chunk
        except ConnectionResetError:
            pass  # cut: what the router still held for the client is dropped
    assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"0\r\n\r\n"), "cut, not ended"
    assert engine.streams_cut == 1
    labels = {"route": "/generate", "status": "504"}
    router.wait_for(
        lambda: metric_value(router.client.get("/metrics").text, "rlfleet_router_requests_total", labels) == 1,
        timeout=3,
        what="the stream counted as past its deadline",
    )
    assert served == (["/generate"] if path == "parser" else [])


def test_an_abort_by_rid_that_would_stop_other_requests_is_not_sent(
    one_engine: tuple[FakeEngine, RunningRouter],
) -> None:
    engine, router = one_engine
    with ThreadPoolExecutor(max_workers=1) as pool:
        # Another client's request, its rid starting with the leaving one's: SGLang's abort of "run/1" stops it too.
        other = pool.submit(router.client.post, "/generate", json={"text": "other", "rid": "run/10", "delay": 2})
        with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
            sock.sendall(post("/generate", {"text": "leaving", "rid": "run/1", "delay": 20}))
            router.wait_for(lambda: engine.in_flight == 2, what="both requests at the engine")
        router.wait_for(lambda: router.workers()[0]["in_flight"] == 1, timeout=3, what="the left request given up")
        assert other.result(timeout=10).status_code == 200
    assert engine.aborted() == []
    # With no other request of the router's there that it would stop, a leaving client's request is aborted by rid.
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.sendall(post("/generate", {"text": "leaving again", "rid": "run/1", "delay": 20}))
        router.wait_for(lambda: router.workers()[0]["in_flight"] == 1, what="the request at the engine")
    router.wait_for(lambda: engine.aborted() == ["run/1"], timeout=3, what="the abort")


def test_generation_requests_are_bound_by_their_head_not_their_body(
    one_engine: tuple[FakeEngine, RunningRouter], served: list[str]
) -> None:
    """The router's protocol bounds heads as every service's does (rlfleet.http_head_limit), generation requests
    served from the parser included: a long prompt is body, and a header past the bound is refused as it arrives."""
    _, router = one_engine
    long_prompt = post("/generate", {"text": "x" * (4 * MAX_HEAD_BYTES)})
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        for raw in (post("/generate", {"text": "q"}), long_prompt, post("/generate", {"text": "r"})):
            sock.sendall(raw)
            [(status, _, _)] = read_answers(sock, 1)
            assert status == 200
    assert served == ["/generate"] * 3
    with socket.create_connection(("127.0.0.1", router.server.port)) as sock:
        sock.settimeout(10)
        # A head that never ends, one byte past the bound: only a refusal as it arrives answers it, and the router
        # reads every byte before it closes (bytes left unread would make the close a reset, which may discard
        # the answer before it is read).
        start = b"POST /generate HTTP/1.1\r\nhost: r\r\nx-padding: "
        sock.sendall(start + b"p" * (MAX_HEAD_BYTES + 1 - len(start)))
        [(status, _, body)] = read_answers(sock, 1)
    assert status == 431 and b"request line and headers are over" in body
