"""The OpenAI routes as OpenAI clients use them: the router's own errors in OpenAI's shape (plain answers and a
stream's error event), request fields relayed untouched, and the requests a trajectory refuses."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from router_fakes import FakeEngine, RunningRouter

from rlfleet.processes import free_port

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


def assert_openai_error(answer: httpx.Response, status: int, says: str) -> None:
    """`answer` is an error OpenAI clients read: `{"error": {"message", "type", "param", "code"}}`."""
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert says in error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), error
    assert "param" in error and error["param"] is None, error
    assert error["code"] == status, error


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_router_errors_on_openai_routes_are_in_openai_shape(
    route: str, start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a", serves_openai=True)
    router = start_router([engine.url])
    router.wait_healthy(1)
    json_type = {"content-type": "application/json"}
    assert_openai_error(router.client.post(route, json=[{"role": "user"}]), 400, "must be a JSON object")
    assert_openai_error(router.client.post(route, content=b'{"prompt": ', headers=json_type), 400, "not valid JSON")
    assert_openai_error(router.client.post(route, content=b'"hi"', headers=json_type), 400, "must be a JSON object")
    method = router.client.put(route, json={"model": "m"})
    assert_openai_error(method, 405, "method not allowed")
    assert method.headers["allow"] == "POST"
    assert not engine.raw_bodies, "nothing reached the engine"
    # The router's other routes keep its own shape.
    native = router.client.post("/generate", json=[1]).json()["error"]
    assert native["kind"] == "invalid_input" and "type" not in native, native


def test_no_engine_on_an_openai_route_is_an_openai_503(start_router: Callable[..., RunningRouter]) -> None:
    router = start_router([f"http://127.0.0.1:{free_port()}"])
    answer = router.client.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert_openai_error(answer, 503, "no healthy engine")
    assert answer.json()["error"]["kind"] == "unavailable"  # the router's own field stays
    assert answer.headers["retry-after"] == "1"


def test_a_body_over_the_bound_on_an_openai_route_is_an_openai_413(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a", serves_openai=True)
    router = start_router([engine.url], max_request_bytes=1024)
    router.wait_healthy(1)
    answer = router.client.post("/v1/completions", json={"model": "m", "prompt": "x" * 4096})
    assert_openai_error(answer, 413, "request body over 1024 bytes")


def test_stream_cut_by_its_engine_ends_with_an_openai_error_event_and_no_repeat(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """An engine that dies mid-stream: the client has each event once, then an error event OpenAI clients raise on
    (openai-python reads `error.message` of an event with an `error`), then a cut connection, never `[DONE]`."""
    engine = start_engine("a", serves_openai=True)
    router = start_router([engine.url])
    router.wait_healthy(1)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "rid": "chat-cut"}
    lines: list[str] = []
    with pytest.raises(httpx.HTTPError):
        with router.client.stream("POST", "/v1/chat/completions", json={**body, "chunks": 6, "cut_after": 3}) as r:
            lines.extend(line for line in r.iter_lines() if line)
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert [e["index"] for e in events[:-1]] == [0, 1, 2], "each event once, none sent again from another engine"
    assert "data: [DONE]" not in lines
    error = events[-1]["error"]
    assert error["type"] == "server_error" and error["param"] is None and error["code"] == 503, error
    assert "stream cut short" in error["message"] and error["kind"] == "unavailable", error
    assert len(engine.raw_bodies) == 1, "a stream under way is never retried"


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_openai_fields_reach_the_engine_as_sent(
    route: str, start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Tools, tool_choice, content parts, user, n, logprobs, stream_options, a rid list: the bytes the client sent."""
    engine = start_engine("a", serves_openai=True)
    router = start_router([engine.url], policy="cache_aware")
    router.wait_healthy(1)
    fields: dict[str, object] = {"model": "m", "n": 2, "user": "u-1", "rid": ["r-0", "r-1"]}
    if route == "/v1/chat/completions":
        parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;x"}}]
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        fields |= {"messages": [{"role": "user", "content": parts}], "tools": [tool], "tool_choice": "required"}
        fields |= {"logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    else:
        fields |= {"prompt": [[1, 2, 3], [4, 5]], "echo": True, "logprobs": 3}
    raw = json.dumps(fields, separators=(",", ":")).encode() + b"  "
    answer = router.client.post(route, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert engine.raw_bodies == [raw]


def test_a_trajectory_turn_with_echo_is_refused_naming_the_field(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang answers `echo` with the prompt's logprobs (the first one null) before the output's: such a turn could
    never be read, and the trajectory would fail only when its sample is asked for."""
    engine = start_engine("a", serves_openai=True)
    router = start_router([engine.url])
    router.wait_healthy(1)
    body = {"model": "m", "prompt": [1, 2, 3], "return_token_ids": True, "logprobs": 0, "echo": True}
    answer = router.client.post("/v1/completions", json=body, headers={"x-rlfleet-trajectory-id": "t/echo"})
    assert_openai_error(answer, 400, "echo: must be false")
    assert not engine.raw_bodies
