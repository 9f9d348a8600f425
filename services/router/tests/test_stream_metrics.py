"""What streamed answers add to the router's metrics: the usage they report, and their failures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from fastapi import Request
from fastapi.responses import StreamingResponse
from router_fakes import FakeEngine, RunningRouter, ThreadedServer, metric_value

from rlfleet_router.chars_per_token import DEFAULT_CHARS_PER_TOKEN


@pytest.fixture
def openai_engine() -> Iterator[FakeEngine]:
    """A fake engine whose /v1/completions streams as SGLang does with stream_options.include_usage and
    continuous_usage_stats (a character-level tokenizer, 8 prompt tokens cached)."""
    engine = FakeEngine(name="openai")
    app = engine.app()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        prompt = str((await request.json())["prompt"])
        running = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1}
        total = {**running, "prompt_tokens_details": {"cached_tokens": 8}}

        async def events() -> AsyncIterator[bytes]:
            for choices, usage in (
                ([{"index": 0, "text": "4", "finish_reason": "length"}], running),
                ([], total),
            ):
                event = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices, "usage": usage}
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    engine.server = ThreadedServer(app).start()
    yield engine
    engine.server.stop()


def test_a_streamed_openai_answer_counts_its_usage_and_teaches_the_tokenizer(
    openai_engine: FakeEngine, start_router: Callable[..., RunningRouter]
) -> None:
    router = start_router([openai_engine.url])
    router.wait_healthy(1)
    prompt = "x" * 400  # 400 tokens to a character-level tokenizer
    body = {"model": "m", "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
    with router.client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    engine = {"engine": openai_engine.url}
    metrics = router.client.get("/metrics").text
    # Once: the running count on the finishing choice is not added to the total.
    assert metric_value(metrics, "rlfleet_router_prompt_tokens_total", engine) == 400
    assert metric_value(metrics, "rlfleet_router_cached_tokens_total", engine) == 8
    estimate = metric_value(metrics, "rlfleet_router_chars_per_token")
    assert estimate is not None and estimate < DEFAULT_CHARS_PER_TOKEN, "400 characters were 400 tokens"


def test_a_stream_cut_by_its_engine_dying_counts_as_a_failure(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("dies")
    router = start_router([engine.url])
    router.wait_healthy(1)
    lines: list[str] = []
    body = {"rid": "cut-2", "stream": True, "chunks": 10, "cut_after": 2}
    with pytest.raises(httpx.HTTPError):
        with router.client.stream("POST", "/generate", json=body) as r:
            lines.extend(line for line in r.iter_lines() if line)
    assert [json.loads(line.removeprefix("data: ")).get("index") for line in lines[:2]] == [0, 1]
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["kind"] == "unavailable" and "connection lost mid-response" in error["message"], error
    labels = {"route": "/generate", "status": "503"}
    router.wait_for(
        lambda: metric_value(router.client.get("/metrics").text, "rlfleet_router_requests_total", labels) == 1,
        what="the cut stream counted as a 503",
    )
    metrics = router.client.get("/metrics").text
    assert metric_value(metrics, "rlfleet_router_requests_total", {"route": "/generate", "status": "200"}) == 0
    errors = {"engine": engine.url, "kind": "connection"}
    assert metric_value(metrics, "rlfleet_router_engine_errors_total", errors) == 1
    # A connection lost may be the network's doing, not the engine's end: it is asked to stop the request too.
    router.wait_for(lambda: engine.aborted() == ["cut-2"], what="the cut stream aborted at its engine by rid")
