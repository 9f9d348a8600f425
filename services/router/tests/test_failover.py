"""Requests at an engine that fails: moved to another engine while nothing reached their client, else ended
with an error; the failed engine is asked to abort them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from router_fakes import FakeEngine, RunningRouter, metric_value

from rlfleet_router.engine_client import EngineClient, EngineConnectTimeout
from rlfleet_router.generation_relay import GenerationRelay
from rlfleet_router.policies import CacheAware

# Far above what a failover takes: a request still at the hung engine would run into it.
REQUEST_TIMEOUT_SECS = 8.0


def stream_lines(router: RunningRouter, body: dict[str, object]) -> list[str]:
    with router.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def fail_over(
    router: RunningRouter, hung: FakeEngine, spare: FakeEngine, send: Callable[[], object]
) -> tuple[object, float]:
    """Runs `send` while its request sits at `hung`, then brings `spare` into routing and fails `hung`'s probes.

    Returns what `send` returned and the seconds from `hung`'s failure to it.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: Future[object] = pool.submit(send)
        router.wait_for(lambda: len(hung.raw_bodies) == 1, what="the request at the hung engine")
        spare.healthy = True
        router.wait_healthy(2)
        failed_at = time.monotonic()
        hung.healthy = False  # its probes fail: it leaves routing
        result = pending.result(timeout=REQUEST_TIMEOUT_SECS + 5)
        return result, time.monotonic() - failed_at


@pytest.fixture
def hung_and_spare(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> tuple[FakeEngine, FakeEngine, RunningRouter]:
    """A hung engine in routing and a spare one that is not yet (its probes fail until a test says otherwise)."""
    hung, spare = start_engine("hung", hang=True), start_engine("spare", healthy=False)
    router = start_router([hung.url, spare.url], request_timeout_secs=REQUEST_TIMEOUT_SECS)
    router.wait_healthy(1)
    return hung, spare, router


def test_a_request_at_a_hung_engine_moves_to_another_under_its_rid(
    hung_and_spare: tuple[FakeEngine, FakeEngine, RunningRouter],
) -> None:
    hung, spare, router = hung_and_spare
    body = {"text": "2+2=", "rid": "req-1"}
    answer, seconds = fail_over(router, hung, spare, lambda: router.client.post("/generate", json=body))
    assert isinstance(answer, httpx.Response)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["engine"] == "spare" and answer.headers["x-rlfleet-engine"] == spare.url
    assert seconds < 3, "moved once the engine left routing, not at the request's deadline"
    assert [json.loads(raw)["rid"] for raw in hung.raw_bodies + spare.raw_bodies] == ["req-1", "req-1"]
    router.wait_for(lambda: hung.aborted() == ["req-1"], what="the hung engine asked to abort the request")
    router.wait_for(lambda: all(w["in_flight"] == 0 for w in router.workers()), what="both slots released")
    metrics = router.client.get("/metrics").text
    failed = {"engine": hung.url, "kind": "engine_failed"}
    assert metric_value(metrics, "rlfleet_router_engine_errors_total", failed) == 1
    assert metric_value(metrics, "rlfleet_router_retries_total") == 1


def test_a_stream_hung_before_its_first_event_moves_to_another(
    hung_and_spare: tuple[FakeEngine, FakeEngine, RunningRouter],
) -> None:
    hung, spare, router = hung_and_spare
    body = {"text": "2+2=", "rid": "stream-1", "stream": True, "chunks": 3}
    lines, seconds = fail_over(router, hung, spare, lambda: stream_lines(router, body))
    assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
    assert [json.loads(line.removeprefix("data: "))["engine"] for line in lines[:-1]] == ["spare"] * 3
    assert seconds < 3
    router.wait_for(lambda: hung.aborted() == ["stream-1"], what="the hung engine asked to abort the stream")


def test_a_stream_under_way_at_an_engine_that_fails_ends_with_an_error(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], request_timeout_secs=REQUEST_TIMEOUT_SECS)
    router.wait_healthy(1)
    lines: list[str] = []
    body = {"text": "long", "rid": "cut-1", "stream": True, "chunks": 200, "chunk_delay": 0.05}
    started = time.monotonic()
    with pytest.raises(httpx.HTTPError):  # a cut connection, never the stream's false end
        with router.client.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    engine.healthy = False
    assert time.monotonic() - started < 5, "ended when the engine left routing, not after its 10 s stream"
    assert "data: [DONE]" not in lines
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["kind"] == "unavailable" and engine.url in error["message"], error
    labels = {"route": "/generate", "status": "503"}
    router.wait_for(
        lambda: metric_value(router.client.get("/metrics").text, "rlfleet_router_requests_total", labels) == 1,
        what="the stream counted as the failure it was",
    )
    metrics = router.client.get("/metrics").text
    assert (
        metric_value(metrics, "rlfleet_router_engine_errors_total", {"engine": engine.url, "kind": "engine_failed"})
        == 1
    )
    assert metric_value(metrics, "rlfleet_router_requests_total", {"route": "/generate", "status": "200"}) == 0
    # Out of routing is not stopped: the engine is asked to drop the rest of the generation.
    router.wait_for(lambda: engine.aborted() == ["cut-1"], what="the cut stream aborted at its engine by rid")


@pytest.mark.parametrize("size", [1 << 10, 10 << 20])
def test_a_plain_answer_cut_short_at_its_engine_is_retried_whole_on_another(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter], size: int
) -> None:
    """Up to --max-whole-answer-bytes (256 MiB) an answer is read whole first: a long GRPO group's answer with
    its log-probs, megabytes, never reaches its client truncated."""
    dying, sound = start_engine("dying", dies_mid_answer=True), start_engine("sound")
    router = start_router([dying.url, sound.url], policy="round_robin")
    router.wait_healthy(2)
    for rid in ("big-1", "big-2"):  # round robin: one of them goes to the dying engine first
        answer = router.client.post("/generate", json={"text": "2+2=", "rid": rid, "pad": size})
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"] == "answer from sound" + "x" * size
    cut = [json.loads(raw)["rid"] for raw in dying.raw_bodies]
    assert cut and len(set(cut)) == len(cut), "each went to the dying engine at most once"
    assert metric_value(router.client.get("/metrics").text, "rlfleet_router_retries_total") == len(cut)


def test_a_retry_waiting_for_an_abort_at_an_engine_that_then_fails_goes_to_another(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    # The retry goes back to the one engine in routing and waits there for its first attempt's abort (3 s); the
    # engine fails meanwhile and a spare joins: the retry goes to the spare, not to the engine out of routing.
    first = start_engine("first", control_delay=3.0, dies_mid_answer=True)
    spare = start_engine("spare", healthy=False)
    router = start_router(
        [first.url, spare.url],
        request_timeout_secs=REQUEST_TIMEOUT_SECS,
        retry_max_retries=1,
        retry_initial_backoff_ms=0,
    )
    router.wait_healthy(1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(router.client.post, "/generate", json={"text": "x", "rid": "wait-1"})
        router.wait_for(lambda: first.aborted() == ["wait-1"], what="the first attempt's abort under way")
        first.healthy, spare.healthy = False, True
        router.wait_for(
            lambda: [w["healthy"] for w in router.workers()] == [False, True], what="the engines swapping places"
        )
        started = time.monotonic()
        answer = pending.result(timeout=REQUEST_TIMEOUT_SECS + 5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["engine"] == "spare"
    assert time.monotonic() - started < 3, "sent to the spare once the abort was over, not at its deadline"
    assert len(first.raw_bodies) == 1, "nothing more was sent to the failed engine"


def test_a_connect_cut_short_by_the_requests_deadline_is_not_held_against_the_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told by the clock, a connect that timed out on the request's last moments counted as the engine's failure
    whenever the event loop's timer fired before time.monotonic() reached it (uvloop's, by up to a millisecond):
    the engine left routing for a request that simply ran out of time."""
    engine = start_engine("a")
    router = start_router([engine.url], request_timeout_secs=0.4, health_check_interval_secs=60)
    router.wait_healthy(1)

    async def timed_out(self: EngineClient, origin: object, timeout: float) -> None:
        raise EngineConnectTimeout(f"connecting timed out after {timeout:.3g}s")

    monkeypatch.setattr(EngineClient, "_connect", timed_out)
    answer = router.client.post("/generate", json={"text": "hi"})
    assert answer.status_code == 504 and "ran out of time while connecting" in answer.text, answer.text
    [worker] = router.workers()
    assert worker["healthy"] is True and worker["last_error"] is None, worker


def test_a_retry_on_the_engines_left_keeps_the_steps_placement_counts(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """cache_aware counts the groups and conversations each engine took since the whole fleet's caches were emptied.
    A retry is offered only the engines its request did not fail at: emptying those (a flush one engine refused, a
    restart) is not a new step, and the counts of the step stay."""
    engines = [start_engine("a"), start_engine("b")]
    router = start_router([e.url for e in engines], policy="cache_aware", retry_max_retries=2)
    router.wait_healthy(2)
    prompts = [list(range(1000 * i, 1000 * i + 100)) for i in range(1, 5)]
    for prompt in prompts:
        assert router.client.post("/generate", json={"input_ids": prompt}).status_code == 200
    home = next(e for e in engines if any(json.loads(raw)["input_ids"] == prompts[0] for raw in e.raw_bodies))
    other = next(e for e in engines if e is not home)
    relay = router.server.server.config.app
    assert isinstance(relay, GenerationRelay) and isinstance(relay.fleet.policy, CacheAware)
    policy = relay.fleet.policy
    workers = {w["url"]: w["id"] for w in router.workers()}

    def placed() -> dict[str, float]:
        return {e.name: policy._placed.score(workers[e.url]) for e in engines}

    home.generate_status = 503  # the conversation's next turn fails where its history is, and goes to the other
    answer = router.client.post("/generate", json={"input_ids": [*prompts[0], 7, 7, 7]})
    assert answer.status_code == 200 and answer.json()["meta_info"]["engine"] == other.name, answer.text
    home.generate_status = 200
    counts = placed()
    assert sum(counts.values()) == 5, counts  # four conversations, and the turn placed anew on the other engine
    home.refused_controls = {"/flush_cache"}
    assert router.client.post("/flush_cache").status_code == 502  # only the other engine's cache was emptied
    assert placed() == counts, "one engine emptied is not a new step"
    home.refused_controls = set()
    assert router.client.post("/flush_cache").status_code == 200
    assert set(placed().values()) == {0.0}, "the whole fleet emptied: a new step"


def test_a_request_at_an_engine_out_of_routing_moves_once_that_engine_fails_its_probes(
    hung_and_spare: tuple[FakeEngine, FakeEngine, RunningRouter],
) -> None:
    """An engine taken out of routing (here: it failed a weight load) keeps its requests, to finish there; once it
    then fails its probes in a row it is as failed as one that left routing that way. Before, its requests were
    left to wait for it until their deadline."""
    hung, spare, router = hung_and_spare
    hung.fail_updates = True
    body = {"text": "2+2=", "rid": "req-out"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: Future[httpx.Response] = pool.submit(lambda: router.client.post("/generate", json=body))
        router.wait_for(lambda: len(hung.raw_bodies) == 1, what="the request at the hung engine")
        spare.healthy = True
        router.wait_healthy(2)
        update = router.client.post("/update_weights_from_disk", json={"model_path": "/ckpt/1", "weight_version": "1"})
        assert update.status_code == 502, update.text
        router.wait_healthy(1)  # the hung engine left routing, its request still there
        failed_at = time.monotonic()
        hung.healthy = False
        answer = pending.result(timeout=REQUEST_TIMEOUT_SECS + 5)
        seconds = time.monotonic() - failed_at
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-rlfleet-engine"] == spare.url
    assert seconds < 3, "moved once the engine failed its probes, not at the request's deadline"
    router.wait_for(lambda: hung.aborted() == ["req-out"], what="the failed engine asked to abort the request")
