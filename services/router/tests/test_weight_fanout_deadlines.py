"""A weight update fan-out answers the trainer in bounded time: an engine that hangs (accepts
connections, never answers) is not waited for once its health checks take it out of routing, and no
engine is waited for longer than the fan-out deadline, whatever `weight_update_timeout_secs` says."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from fastapi import Request, Response
from router_fakes import FakeEngine, RunningRouter, ThreadedServer, metric_value

from rlfleet_router import weights


class HangingEngine:
    """A fake engine that can be made to hang: every request it gets then waits without an answer."""

    def __init__(self, name: str) -> None:
        self.engine = FakeEngine(name=name)
        self.hung = threading.Event()  # set and cleared by the test's thread
        app = self.engine.app()

        @app.middleware("http")
        async def hang(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            while self.hung.is_set():
                await asyncio.sleep(0.05)
            return await call_next(request)

        self.engine.server = ThreadedServer(app).start()

    @property
    def url(self) -> str:
        return self.engine.url


@pytest.fixture
def hanging_engine() -> Iterator[Callable[[str], HangingEngine]]:
    started: list[HangingEngine] = []

    def start(name: str) -> HangingEngine:
        started.append(HangingEngine(name))
        return started[-1]

    yield start
    for engine in started:
        engine.hung.clear()
        assert engine.engine.server is not None
        engine.engine.server.stop()


def test_engine_hanging_during_an_update_is_not_waited_for_and_rejoins_on_the_new_version(
    start_engine: Callable[..., FakeEngine],
    start_router: Callable[..., RunningRouter],
    hanging_engine: Callable[[str], HangingEngine],
) -> None:
    good = start_engine("good", update_delay=0.2)
    hung = hanging_engine("hung")
    router = start_router(
        [good.url, hung.url],
        health_check_timeout_secs=0.5,
        weight_update_timeout_secs=60.0,
    )
    router.wait_healthy(2)

    # Hangs just before the update: still in routing when the fan-out starts.
    hung.hung.set()
    start = time.monotonic()
    answer = router.client.post("/update_weights_from_disk", json={"model_path": "/ckpt/1", "weight_version": "1"})
    elapsed = time.monotonic() - start

    assert elapsed < 10, f"the fan-out waited {elapsed:.1f}s for a hung engine (update timeout 60 s)"
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["weight_version"] == "1"
    assert [r["url"] for r in result["engines"]] == [good.url] and result["engines"][0]["success"] is True
    assert [s["url"] for s in result["skipped"]] == [hung.url]
    assert result["skipped"][0]["state"] == "unhealthy" and result["skipped"][0]["reason"]
    assert "not waited for" in result["message"]
    assert metric_value(router.client.get("/metrics").text, "rlfleet_router_weight_update_engines_skipped_total") == 1

    # Continued, it is re-admitted on the fleet's version, never on the one it had.
    hung.hung.clear()
    router.wait_healthy(2, timeout=15)
    assert hung.engine.weight_version == "1"
    assert {w["weight_version"] for w in router.workers()} == {"1"}


def test_fanout_waits_no_engine_longer_than_its_deadline(
    start_engine: Callable[..., FakeEngine],
    start_router: Callable[..., RunningRouter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights, "FANOUT_ENGINE_DEADLINE_SECS", 1.0)
    fast, slow = start_engine("fast"), start_engine("slow", update_delay=30.0)
    router = start_router([fast.url, slow.url], weight_update_timeout_secs=600.0)
    router.wait_healthy(2)

    start = time.monotonic()
    answer = router.client.post("/update_weights_from_disk", json={"model_path": "/ckpt/2", "weight_version": "2"})
    elapsed = time.monotonic() - start

    assert elapsed < 5, f"the fan-out waited {elapsed:.1f}s for a slow engine (deadline 1 s)"
    result = answer.json()
    assert answer.status_code == 502 and result["weight_version"] == "2", answer.text
    late = next(r for r in result["engines"] if r["url"] == slow.url)
    assert late["success"] is False and "Timeout" in late["message"]
    assert {w["url"] for w in router.workers() if w["healthy"]} == {fast.url}


@pytest.mark.parametrize(
    ("route", "body"),
    [("/update_weights_from_disk", {"model_path": "/ckpt/1", "weight_version": "1"}), ("/pause_generation", {})],
)
def test_an_engine_removed_while_a_fanout_waits_for_it_is_waited_for_no_more(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter], route: str, body: dict
) -> None:
    """Removing a hung engine to free the trainer's fan-out made it wait out the engine's whole deadline (100 s for
    a weight update, --control-timeout-secs for a control), and the answer counted the engine."""
    kept, removed = start_engine("kept"), start_engine("removed", update_delay=30.0, control_delay=30.0)
    router = start_router([kept.url, removed.url], control_timeout_secs=60.0, weight_update_timeout_secs=600.0)
    router.wait_healthy(2)
    removed_id = next(w["id"] for w in router.workers() if w["url"] == removed.url)
    remove = threading.Timer(0.5, lambda: router.client.delete(f"/workers/{removed_id}"))
    remove.start()
    try:
        start = time.monotonic()
        answer = router.client.post(route, json=body)
        elapsed = time.monotonic() - start
    finally:
        remove.join(5)
    assert elapsed < 5, f"the fan-out waited {elapsed:.1f}s for an engine removed after 0.5 s"
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert "1/1 engines" in result["message"], result["message"]
    assert [e["url"] for e in result["engines"]] == [kept.url]
    assert not result.get("skipped")
