"""An engine removed from the fleet leaves no series behind, whatever was still under way there finishes later."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from fastapi import Request
from fastapi.responses import StreamingResponse
from router_fakes import FakeEngine, RunningRouter, ThreadedServer, metric_value

from rlfleet_router.busy_engines import BusyEngines
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.workers import WorkerRegistry

PROMPT_TOKENS = 13
CACHED_TOKENS = 4
ENGINE_COUNTERS = (
    "engine_errors",
    "prompt_tokens",
    "cached_tokens",
    "engine_restarts",
    "health_check_failures",
    "engine_version_drifts",
)


class HeldEngine(FakeEngine):
    """A fake engine whose OpenAI streams send a first chunk, then wait for `release` (10 s at most) to send their
    usage chunk, or to die mid-stream when the prompt is "die"."""

    def __init__(self) -> None:
        super().__init__(name="held")
        self.release = threading.Event()
        self.streams = 0  # streams that sent their first chunk

    def held_app(self) -> ThreadedServer:
        app = self.app()

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            prompt = str((await request.json())["prompt"])
            usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}

            async def events() -> AsyncIterator[bytes]:
                choice = {"choices": [{"index": 0, "text": "4", "finish_reason": None}]}
                yield b"data: " + json.dumps(choice).encode() + b"\n\n"
                self.streams += 1
                await asyncio.to_thread(self.release.wait, 10.0)
                if prompt == "die":
                    raise ConnectionAbortedError("held dies mid-stream")  # uvicorn drops the connection
                yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return ThreadedServer(app)


@pytest.fixture
def held_engine() -> Iterator[HeldEngine]:
    engine = HeldEngine()
    engine.server = engine.held_app().start()
    yield engine
    engine.release.set()
    engine.server.stop()


def stream(router: RunningRouter, prompt: str, outcomes: dict[str, str]) -> threading.Thread:
    """Streams `prompt` in a thread; `outcomes[prompt]` is then its last line, or "cut" if it ended in an error."""

    def run() -> None:
        body = {"model": "m", "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(base_url=router.url, timeout=30.0, trust_env=False) as client:
                with client.stream("POST", "/v1/completions", json=body) as answer:
                    lines = [line for line in answer.iter_lines() if line]
            outcomes[prompt] = lines[-1]
        except httpx.HTTPError:
            outcomes[prompt] = "cut"

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def engine_series(exposition: str, url: str) -> list[str]:
    return [line for line in exposition.splitlines() if not line.startswith("#") and f'engine="{url}"' in line]


def test_requests_that_finish_after_their_engine_left_bring_back_none_of_its_series(
    held_engine: HeldEngine, start_router: Callable[..., RunningRouter]
) -> None:
    router = start_router([held_engine.url])
    router.wait_healthy(1)
    outcomes: dict[str, str] = {}
    # One stream reports its usage after the removal, the other is cut by its engine dying (a connection error).
    threads = [stream(router, "x" * PROMPT_TOKENS, outcomes), stream(router, "die", outcomes)]
    router.wait_for(lambda: held_engine.streams == 2, what="both streams under way at the engine")
    assert router.client.delete(f"/workers/{held_engine.url}").status_code == 200
    assert engine_series(router.client.get("/metrics").text, held_engine.url) == []

    held_engine.release.set()
    for thread in threads:
        thread.join(timeout=30.0)
    assert outcomes == {"x" * PROMPT_TOKENS: "data: [DONE]", "die": "cut"}, outcomes
    assert engine_series(router.client.get("/metrics").text, held_engine.url) == []


def test_an_engine_added_again_under_its_url_has_its_series_again_from_zero(
    held_engine: HeldEngine, start_router: Callable[..., RunningRouter]
) -> None:
    router = start_router([held_engine.url])
    router.wait_healthy(1)
    outcomes: dict[str, str] = {}
    late = stream(router, "x" * PROMPT_TOKENS, outcomes)
    router.wait_for(lambda: held_engine.streams == 1, what="a stream under way at the engine")
    assert router.client.delete(f"/workers/{held_engine.url}").status_code == 200
    held_engine.release.set()
    late.join(timeout=30.0)
    assert router.client.post("/workers", json={"url": held_engine.url}).status_code in (200, 201, 202)
    router.wait_healthy(1)

    engine = {"engine": held_engine.url}
    text = router.client.get("/metrics").text
    for name in ENGINE_COUNTERS:  # the answer that ended while it was out counted nowhere
        assert metric_value(text, f"rlfleet_router_{name}_total", engine) == 0, name
    stream(router, "y" * PROMPT_TOKENS, outcomes).join(timeout=30.0)
    text = router.client.get("/metrics").text
    assert metric_value(text, "rlfleet_router_prompt_tokens_total", engine) == PROMPT_TOKENS
    assert metric_value(text, "rlfleet_router_cached_tokens_total", engine) == CACHED_TOKENS


def test_no_per_engine_counter_counts_for_a_forgotten_engine() -> None:
    """Every counter labelled by engine, counted the way its callers count, after the engine left."""
    url = "http://127.0.0.1:9"
    metrics = RouterMetrics(WorkerRegistry(failure_threshold=1, success_threshold=1), lambda: None)
    metrics.add_engine(url)
    labelled = {m.name for m in metrics.registry.collect() if any(s.labels.get("engine") for s in m.samples)}
    assert labelled == {f"rlfleet_router_{name}" for name in ENGINE_COUNTERS}, "a per-engine counter left unchecked"
    metrics.forget_engine(url)

    for kind in ("connection", "http_5xx", "engine_failed"):
        metrics.engine_errors.inc(url, kind)
    for result in ("success", "failure"):
        metrics.restarts.inc(url, result)
    metrics.prompt_tokens.inc(url, amount=PROMPT_TOKENS)
    metrics.cached_tokens.inc(url, amount=CACHED_TOKENS)
    metrics.health_check_failures.inc(url)
    metrics.engine_version_drifts.inc(url)
    assert engine_series(metrics.exposition().decode(), url) == []

    metrics.add_engine(url)
    metrics.engine_errors.inc(url, "connection")
    errors = {"engine": url, "kind": "connection"}
    assert metrics.registry.get_sample_value("rlfleet_router_engine_errors_total", errors) == 1


def test_a_count_under_a_label_value_the_counter_does_not_have_is_a_bug() -> None:
    metrics = RouterMetrics(WorkerRegistry(failure_threshold=1, success_threshold=1), lambda: None)
    metrics.add_engine("http://127.0.0.1:9")
    with pytest.raises(AssertionError, match="rlfleet_router_engine_errors"):
        metrics.engine_errors.inc("http://127.0.0.1:9", "timeout")


def test_a_removed_engine_busy_loading_or_paused_leaves_no_series_before_the_next_health_round() -> None:
    """rlfleet_router_engine_busy kept a removed engine's series until the health round that forgets it (every
    --health-check-interval-secs), and a load that ended there after a round brought it back; read from the fleet at
    scrape time like the other per-engine gauges, it goes with the engine. A worker added again at the URL shows as
    one series, its own."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    metrics = RouterMetrics(workers, lambda: None)
    busy = BusyEngines(60.0, metrics.registry, workers)
    loading, _ = workers.add("http://127.0.0.1:9")
    paused, _ = workers.add("http://127.0.0.1:10")
    busy.start_loading([loading])
    busy.start_loading([loading])  # a second request under way there: one end leaves it loading
    busy.pause([paused], time.monotonic() + 60.0)
    text = metrics.exposition().decode()
    assert metric_value(text, "rlfleet_router_engine_busy", {"engine": loading.url, "reason": "loading"}) == 1
    assert metric_value(text, "rlfleet_router_engine_busy", {"engine": paused.url, "reason": "paused"}) == 1

    for worker in (loading, paused):
        workers.remove(worker.id)
    assert engine_series(metrics.exposition().decode(), loading.url) == []
    assert engine_series(metrics.exposition().decode(), paused.url) == []
    busy.keep_only(workers.all())  # the health round
    busy.end_loading([loading])
    assert engine_series(metrics.exposition().decode(), loading.url) == []

    again, _ = workers.add(paused.url)
    busy.pause([again], time.monotonic() + 60.0)
    busy_series = [s for s in engine_series(metrics.exposition().decode(), paused.url) if "_engine_busy{" in s]
    assert busy_series == [f'rlfleet_router_engine_busy{{engine="{paused.url}",reason="paused"}} 1.0']
