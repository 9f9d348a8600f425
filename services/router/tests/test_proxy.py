"""POST /generate through the router: body passthrough, streaming, load spreading, retries, errors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from router_fakes import FakeEngine, RunningRouter, metric_value

from rlfleet.processes import free_port
from rlfleet_router.radix_tree import NODE_TOKENS


def test_body_reaches_the_engine_byte_for_byte(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    # Unusual spacing, key order and a field no SGLang version knows: all must survive.
    raw = b'{"text":"12+7=",  "sampling_params": {"max_new_tokens": 4, "temperature": 0},"return_logprob": true,'
    raw += b' "rlfleet_unknown_field": {"nested": [1, 2.5, null]}}'
    response = router.client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["meta_info"]["engine"] == "a"
    assert response.headers["x-rlfleet-engine"] == engine.url
    assert engine.raw_bodies == [raw]


def test_streaming_answer_is_relayed_as_it_is_produced(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    body = {"text": "hi", "stream": True, "chunks": 5, "chunk_delay": 0.2}
    arrivals: list[float] = []
    lines: list[str] = []
    start = time.monotonic()
    with router.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                lines.append(line)
                arrivals.append(time.monotonic() - start)
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line.removeprefix("data: "))["index"] for line in lines[:-1]] == [0, 1, 2, 3, 4]
    # The engine needs ~1 s for all chunks; a buffering proxy would deliver the first one at the end.
    assert arrivals[0] < arrivals[-1] - 0.5


def test_stream_past_the_deadline_is_cut_off_not_completed(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], request_timeout_secs=1.0)
    router.wait_healthy(1)
    lines: list[str] = []
    with pytest.raises(httpx.HTTPError):
        with router.client.stream("POST", "/generate", json={"stream": True, "chunks": 20, "chunk_delay": 0.2}) as r:
            lines.extend(line for line in r.iter_lines() if line)
    assert 0 < len(lines) < 20 and "data: [DONE]" not in lines
    router.wait_for(lambda: router.workers()[0]["in_flight"] == 0, what="the engine slot released")


def test_client_leaving_mid_stream_releases_the_engine_slot(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    # The engine would stream for 20 s; the slot must free up soon after the client leaves.
    with router.client.stream("POST", "/generate", json={"stream": True, "chunks": 200, "chunk_delay": 0.1}) as r:
        lines = r.iter_lines()  # held: dropping a half-read iterator closes the connection early
        assert next(lines).startswith("data: ")
        assert router.workers()[0]["in_flight"] == 1
    router.wait_for(lambda: router.workers()[0]["in_flight"] == 0, timeout=3, what="the engine slot released")


def test_least_load_spreads_concurrent_requests(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engines = [start_engine(name) for name in "abc"]
    router = start_router([e.url for e in engines], policy="least_load")
    router.wait_healthy(3)
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(lambda _: router.client.post("/generate", json={"text": "x", "delay": 0.5}), range(6)))
    assert all(a.status_code == 200 for a in answers)
    assert [len(e.raw_bodies) for e in engines] == [2, 2, 2]
    assert max(e.max_in_flight for e in engines) == 2


def test_least_load_avoids_the_busy_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    busy, idle = start_engine("busy"), start_engine("idle")
    router = start_router([busy.url, idle.url], policy="least_load")
    router.wait_healthy(2)
    with ThreadPoolExecutor(max_workers=1) as pool:
        long_request = pool.submit(router.client.post, "/generate", json={"text": "long", "delay": 1.5})
        router.wait_for(lambda: busy.in_flight + idle.in_flight == 1, what="the long request to start")
        holder = busy if busy.in_flight else idle
        other = idle if holder is busy else busy
        for _ in range(4):
            assert router.client.post("/generate", json={"text": "short"}).status_code == 200
        assert long_request.result(timeout=10).status_code == 200
    assert len(holder.raw_bodies) == 1 and len(other.raw_bodies) == 4


def test_connection_error_is_retried_on_another_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    doomed, alive = start_engine("doomed"), start_engine("alive")
    # Probes far apart: the router learns of the dead engine from the failed request, not a probe.
    router = start_router(
        [doomed.url, alive.url], policy="round_robin", health_check_interval_secs=60, health_failure_threshold=1
    )
    router.wait_healthy(2)
    assert doomed.server is not None
    doomed.server.stop()
    answers = [router.client.post("/generate", json={"text": str(i)}) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json()["meta_info"]["engine"] == "alive" for a in answers)
    dead = next(w for w in router.workers() if w["url"] == doomed.url)
    assert dead["healthy"] is False and "Connect" in str(dead["last_error"])
    retries = metric_value(router.client.get("/metrics").text, "rlfleet_router_retries_total")
    assert retries is not None and retries >= 1


def test_engine_5xx_is_retried_and_passed_through_when_every_engine_fails(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    broken, fine = start_engine("broken", generate_status=500), start_engine("fine")
    router = start_router([broken.url, fine.url], policy="round_robin", retry_max_retries=1)
    router.wait_healthy(2)
    for _ in range(2):
        assert router.client.post("/generate", json={"text": "x"}).json()["meta_info"]["engine"] == "fine"
    assert broken.raw_bodies, "round robin tried the broken engine at least once"
    fine.generate_status = 503
    answer = router.client.post("/generate", json={"text": "x"})
    assert answer.status_code in (500, 503) and answer.json() == {"error": "engine fault"}


def test_no_healthy_engine_is_503_with_the_reason_and_when_to_retry(start_router: Callable[..., RunningRouter]) -> None:
    router = start_router([f"http://127.0.0.1:{free_port()}"], health_check_interval_secs=2.5)
    answer = router.client.post("/generate", json={"text": "x"})
    assert answer.status_code == 503
    assert "no healthy engine: 0 of 1" in answer.json()["error"]["message"]
    # After the next round of health checks, which may bring an engine back: whole seconds.
    assert answer.headers["retry-after"] == "3"
    for other in (router.client.get("/v1/models"), router.client.get("/health")):
        assert (other.status_code, other.headers.get("retry-after")) == (503, "3")


def test_a_connection_lost_after_the_request_was_sent_aborts_it_at_the_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], retry_max_retries=0)
    router.wait_healthy(1)
    # The engine sends the answer's head, then drops the connection: it had the request.
    answer = router.client.post("/generate", json={"text": "x", "rid": "lost-1", "stream": True, "cut_after": 0})
    assert answer.status_code == 503, answer.text
    router.wait_for(lambda: engine.aborted() == ["lost-1"], what="the engine asked to abort the request")


def test_a_retry_back_at_the_same_engine_waits_for_the_abort_of_its_first_attempt(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    # One engine, so the retry goes back to it under the same rid, at once; its abort takes 0.5 s. Sent meanwhile,
    # the retry could reach the engine first and be aborted, or be refused as a duplicate of the first attempt.
    engine = start_engine("a", control_delay=0.5)
    router = start_router([engine.url], retry_max_retries=1, retry_initial_backoff_ms=0)
    router.wait_healthy(1)
    answer = router.client.post("/generate", json={"text": "x", "rid": "again-1", "dies_once": True})
    assert answer.status_code == 200, answer.text
    assert engine.events == ["generate", "abort", "generate"]
    assert engine.aborted() == ["again-1"]


def test_bad_generate_bodies_are_400(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    not_json = router.client.post("/generate", content=b"{text: 1", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    a_list = router.client.post("/generate", json=[1, 2])
    assert a_list.status_code == 400 and "JSON object" in a_list.json()["error"]["message"]
    deep = b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    for route in ("/generate", "/v1/chat/completions", "/abort_request"):
        nested = router.client.post(route, content=deep, headers={"content-type": "application/json"})
        assert nested.status_code == 400, (route, nested.text)
        assert nested.json()["error"]["message"].startswith("body: nested too deeply"), route
    # Python reads at most 4300 digits into an int: a longer one is the client's fault, not the router's.
    long_int = b'{"text": "x", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}"
    for route in ("/generate", "/v1/completions", "/flush_cache"):
        digits = router.client.post(route, content=long_int, headers={"content-type": "application/json"})
        assert digits.status_code == 400, (route, digits.text)
        assert digits.json()["error"]["message"].startswith("body: not valid JSON"), route
    assert engine.raw_bodies == [] and engine.controls == []


def test_token_ids_beyond_32_bits_reach_the_engine_routed_by_load(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The cache_aware tree stores ids as 32-bit ints: a larger one makes no key, and the engine judges the
    request (an id outside its vocabulary is its 400 to give)."""
    engine = start_engine("a")
    router = start_router([engine.url], policy="cache_aware")
    router.wait_healthy(1)
    for ids in ([5, 2**31], [[5, 6], [-(2**40)]], [5, 6]):
        answer = router.client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200, answer.text
    assert [json.loads(raw)["input_ids"] for raw in engine.raw_bodies] == [[5, 2**31], [[5, 6], [-(2**40)]], [5, 6]]
    text = router.client.get("/metrics").text
    assert metric_value(text, "rlfleet_router_routing_decisions_total", {"reason": "no_prompt"}) == 1
    # [5, 6], the batch's first prompt, then the last: 2 tokens in one node.
    assert metric_value(text, "rlfleet_router_tree_tokens") == 2 + NODE_TOKENS


def test_bodies_over_the_bound_are_413_and_never_reach_an_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], max_request_bytes=4096)
    router.wait_healthy(1)
    huge = json.dumps({"text": "x" * 5000}).encode()
    declared = router.client.post("/generate", content=huge, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["kind"] == "resource_exhausted"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield huge[:3000]
        yield huge[3000:]

    chunked = router.client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    admin = router.client.post("/abort_request", content=chunks(), headers={"content-type": "application/json"})
    assert admin.status_code == 413, admin.text
    assert engine.raw_bodies == []
    assert router.client.post("/generate", json={"text": "x" * 100}).status_code == 200


def test_requests_time_out(start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]) -> None:
    engine = start_engine("slow")
    router = start_router([engine.url], request_timeout_secs=0.5)
    router.wait_healthy(1)
    start = time.monotonic()
    answer = router.client.post("/generate", json={"text": "x", "delay": 5})
    assert answer.status_code == 504
    assert time.monotonic() - start < 3


def test_a_plain_answer_trickling_past_the_deadline_is_cut_off(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("slow")
    router = start_router([engine.url], request_timeout_secs=1.0)
    router.wait_healthy(1)
    start = time.monotonic()
    # About 10 pieces 0.3 s apart: each arrives well inside the deadline, the whole answer does not.
    answer = router.client.post("/generate", json={"text": "x", "trickle": 0.3})
    assert answer.status_code == 504, answer.text
    assert engine.url in answer.json()["error"]["message"]
    assert time.monotonic() - start < 2
    router.wait_for(lambda: router.workers()[0]["in_flight"] == 0, what="the engine slot released")


def test_model_and_server_info_pass_through_under_both_names(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang's /model_info and /server_info were a 404 at the router, which relayed only the deprecated names."""
    engine = start_engine(
        "a",
        weight_version="7",
        info_routes=("/model_info", "/get_model_info"),
        server_info_routes=("/server_info", "/get_server_info"),
    )
    router = start_router([engine.url])
    router.wait_healthy(1)
    for route in ("/get_model_info", "/model_info"):
        assert router.client.get(route).json()["weight_version"] == "7"
    for route in ("/get_server_info", "/server_info"):
        assert router.client.get(route).json()["engine"] == "a"
    assert engine.server_info_calls[-2:] == ["/get_server_info", "/server_info"], "relayed as the client asked"
    assert httpx.get(f"{router.url}/liveness", timeout=5).status_code == 200
