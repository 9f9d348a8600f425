"""Engines the router itself keeps busy (loading weights it sent, paused by a /pause_generation it relayed)
are not judged by SGLang's generation probe, which waits behind the load or the pause: a load longer than
the failure window succeeds, a paused fleet stays in routing, a dead engine still leaves, an engine that
finished loading a version the fleet gave up on is never loaded back to the older one, and an engine removed
mid-load leaves the others' bookkeeping whole."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from router_fakes import FakeEngine, GatedEngine, RunningRouter, metric_value

from rlfleet_router import weights

# Probes every 0.1 s that give up after 0.3 s, two failures in a row take an engine out: a failure window
# of well under a second, which every load and pause below outlasts.
PROBES = {"health_check_timeout_secs": 0.3, "health_failure_threshold": 2}


def load(router: RunningRouter, version: str) -> httpx.Response:
    return router.client.post(
        "/update_weights_from_disk", json={"model_path": f"/ckpt/{version}", "weight_version": version}
    )


@pytest.fixture
def start_gated() -> Iterator[Callable[..., GatedEngine]]:
    started: list[GatedEngine] = []

    def start(name: str, **attrs: Any) -> GatedEngine:
        started.append(GatedEngine(name, **attrs).start())
        return started[-1]

    yield start
    for gated in started:
        gated.paused = False
        assert gated.engine.server is not None
        if gated.engine.server._thread.is_alive():
            gated.engine.server.stop()


def test_a_load_longer_than_the_failure_window_succeeds_and_is_never_rolled_back(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engines = [start_gated(name) for name in "ab"]
    # A failure window of about 1.2 s, which the load below outlasts; probes given 0.5 s rather than 0.3, so that
    # a machine busy with other tests does not time one out before the load.
    router = start_router([e.url for e in engines], **{**PROBES, "health_check_timeout_secs": 0.5})
    router.wait_healthy(2)
    assert load(router, "1").status_code == 200

    def failures() -> list[float | None]:
        text = router.client.get("/metrics").text
        return [
            metric_value(text, "rlfleet_router_health_check_failures_total", {"engine": str(w["url"])})
            for w in router.workers()
        ]

    before = failures()
    for gated in engines:
        gated.engine.update_delay = 2.0  # probes wait behind it, as SGLang's do behind model_update_lock
    answer = load(router, "2")

    assert answer.status_code == 200, answer.text
    assert answer.json()["weight_version"] == "2" and answer.json()["skipped"] == []
    router.wait_healthy(2)
    time.sleep(0.5)  # long enough for a rollback to have started
    for gated in engines:
        assert gated.engine.weight_version == "2"
        assert [b["weight_version"] for b in gated.engine.update_bodies] == ["1", "2"]
    assert {w["weight_version"] for w in router.workers()} == {"2"}
    assert before and failures() == before, "no probe failed over the load"


def test_a_paused_fleet_stays_in_routing_and_a_dead_engine_still_leaves_it(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    survivor, victim = start_gated("survivor"), start_gated("victim")
    router = start_router([survivor.url, victim.url], **PROBES)
    router.wait_healthy(2)

    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert survivor.paused and victim.paused
    time.sleep(1.0)  # several failure windows of probes that would wait behind the pause
    assert [w["state"] for w in router.workers()] == ["healthy", "healthy"]
    exposition = router.client.get("/metrics").text
    assert metric_value(exposition, "rlfleet_router_engine_busy", {"engine": victim.url, "reason": "paused"}) == 1

    assert victim.engine.server is not None
    victim.engine.server.stop()  # gone mid-pause: its liveness check is refused
    router.wait_for(lambda: not router.workers()[1]["healthy"], timeout=5, what="the dead engine out of routing")
    assert router.workers()[0]["healthy"] is True

    assert router.client.post("/continue_generation", json={}).status_code == 502  # the victim does not answer
    assert not survivor.paused
    assert metric_value(router.client.get("/metrics").text, "rlfleet_router_engine_busy", {"reason": "paused"}) is None
    time.sleep(0.5)
    assert router.workers()[0]["healthy"] is True


def test_an_engine_that_finished_a_load_the_fleet_gave_up_on_is_not_loaded_back(
    start_gated: Callable[..., GatedEngine],
    start_router: Callable[..., RunningRouter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights, "FANOUT_ENGINE_DEADLINE_SECS", 0.5)
    engines = [start_gated(name) for name in "ab"]
    router = start_router([e.url for e in engines], **PROBES, trajectory_max_update_lag=1)
    router.wait_healthy(2)
    turn = {"input_ids": [1, 2], "return_logprob": True}  # a trajectory on the engines' boot version
    assert router.client.post("/generate", json=turn, headers={"x-rlfleet-trajectory-id": "t"}).status_code == 200
    assert load(router, "1").status_code == 200
    # One version old: kept (the fake's answer holds no tokens, so the turn is recorded as lost: 409).
    assert router.client.get("/trajectories/t").status_code == 409

    for gated in engines:
        gated.engine.update_delay = 1.5  # longer than the fan-out waits: no engine confirms version 2 in time
    answer = load(router, "2")
    assert answer.status_code == 502, answer.text
    assert answer.json()["weight_version"] == "1" and "gave no answer (none in time" in answer.json()["message"]

    # They finish loading version 2: the fleet takes it as its version rather than loading 1 back.
    router.wait_healthy(2, timeout=10)
    assert router.client.get("/weight_version").json()["weight_version"] == "2"
    time.sleep(0.5)
    for gated in engines:
        assert gated.engine.weight_version == "2"
        assert [b["weight_version"] for b in gated.engine.update_bodies] == ["1", "2"]
    assert {w["weight_version"] for w in router.workers()} == {"2"}
    # Two versions old once the fleet took version 2 as its own: dropped as stale, as after any other update.
    assert router.client.get("/trajectories/t").status_code == 404


def test_a_weight_update_group_opens_while_the_trainer_has_generation_paused(
    start_router: Callable[..., RunningRouter],
) -> None:
    engines = [GatedEngine(name) for name in "ab"]
    for gated in engines:

        @gated.app.post("/init_weights_update_group")
        async def init() -> dict[str, object]:
            return {"success": True, "message": "joined"}

    for gated in engines:
        gated.start()
    try:
        router = start_router([e.url for e in engines], **PROBES)
        router.wait_healthy(2)
        # The trainer pauses generation before it opens the group for a version in several buckets.
        assert router.client.post("/pause_generation", json={}).status_code == 200
        time.sleep(0.5)
        body = {"master_address": "10.0.0.9", "master_port": 29500, "group_name": "g", "backend": "gloo"}
        opened = router.client.post("/init_weights_update_group", json={**body, "world_size": 3})
        assert opened.status_code == 200, opened.text
    finally:
        for gated in engines:
            gated.paused = False
            assert gated.engine.server is not None
            gated.engine.server.stop()


def test_a_pause_that_outlives_its_bound_is_ended_by_the_router(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The trainer paused generation and died: past the pause bound (the weight update timeout) the router sends
    /continue_generation itself, or no request would ever be answered again."""
    engines = [start_gated(name) for name in "ab"]
    router = start_router([e.url for e in engines], weight_update_timeout_secs=1.0, **PROBES)
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert all(gated.paused for gated in engines)

    router.wait_for(lambda: not any(gated.paused for gated in engines), timeout=5, what="generation continued")
    answer = router.client.post("/generate", json={"text": "x"}, timeout=5)
    assert answer.status_code == 200, answer.text
    exposition = router.client.get("/metrics").text
    assert metric_value(exposition, "rlfleet_router_expired_pauses_total") == 2
    assert [w["healthy"] for w in router.workers()] == [True, True]


def test_an_engine_removed_while_it_loads_weights_leaves_the_update_and_the_other_engines_whole(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The health round forgot the removed engine's load before the update ended it: the update answered 500, and
    the engines after it stayed busy loading for good, checked for liveness only, however their probes failed."""
    engines = [start_engine(name, update_delay=1.0) for name in "abc"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(3)
    with ThreadPoolExecutor(1) as pool:
        update = pool.submit(load, router, "1")
        time.sleep(0.3)  # the load under way at every engine
        assert router.client.delete(f"/workers/{engines[0].url}").status_code == 200
        answer = update.result(timeout=30)

    assert answer.status_code == 200, answer.text
    assert metric_value(router.client.get("/metrics").text, "rlfleet_router_engine_busy", {"reason": "loading"}) is None
    engines[1].healthy = False  # judged by its probes again: it leaves routing
    router.wait_for(lambda: [w["healthy"] for w in router.workers()] == [False, True], what="b out of routing")
