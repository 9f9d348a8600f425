"""A disk load into an engine holding a weight-update session no update finished: the router ends it first.

SGLang from 0.5.23 brackets distributed updates in `/begin_weight_update` ... `/end_weight_update`, and later SGLang
publishes the version of an update made inside a session only when it ends. A session is left open by a router
restarted mid-version (or an end that failed); a disk load into that engine then leaves it reporting its old version,
which the router's drift check takes for a restart: it reloads the engine, again and again. The fake engines model
that session (`FakeEngine.sessions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router_fakes import FakeEngine, RunningRouter, metric_value

V1 = {"model_path": "/ckpt/1", "weight_version": "1"}


def _settles(router: RunningRouter, engine: FakeEngine, loads: int) -> None:
    """Several health rounds pass with `engine` in routing on version "1", loaded `loads` times in all."""
    time.sleep(1.0)  # ten health-check intervals: time for a drift to be found and reloaded
    router.wait_healthy(len(router.workers()))
    assert engine.weight_version == "1" and not engine.session_open
    assert [b["weight_version"] for b in engine.update_bodies] == ["1"] * loads
    drifts = metric_value(router.client.get("/metrics").text, "rlfleet_router_engine_version_drifts_total")
    assert drifts in (None, 0.0), "an engine reporting its old version after a load is reloaded for drift"


def test_a_fleet_update_ends_a_session_a_restarted_router_left_open(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The trainer's disk fallback after a router restarted between two buckets: the engine still holds the session
    the old router opened, which the new router knows nothing of."""
    held = start_engine("held", sessions=True, session_open=True)
    plain = start_engine("plain")  # no session routes (404): SGLang before 0.5.23, rlfleet-engine
    router = start_router([held.url, plain.url])
    router.wait_healthy(2)
    answer = router.client.post("/update_weights_from_disk", json=V1)
    assert answer.status_code == 200, answer.text
    assert held.session_events == ["end"], "the session is ended before the load, not after"
    _settles(router, held, loads=1)
    assert plain.weight_version == "1"

    assert router.client.post("/update_weights_from_disk", json=V1 | {"model_path": "/ckpt/1b"}).status_code == 200
    assert held.session_events == ["end"], "an engine known to hold no session is not asked again"


def test_an_engine_admitted_with_a_session_left_open_loads_the_fleets_version_once(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """An engine joining a fleet that has a version (new, restarted, stranded) loads it from disk to rejoin: a
    session left open there would hold that version back, and the engine would go round admission and drift."""
    first = start_engine("first")
    router = start_router([first.url])
    router.wait_healthy(1)
    assert router.client.post("/update_weights_from_disk", json=V1).status_code == 200
    joining = start_engine("joining", sessions=True, session_open=True)
    assert router.client.post("/workers", json={"url": joining.url}).status_code == 202
    router.wait_healthy(2)
    assert joining.session_events == ["end"]
    _settles(router, joining, loads=1)


def test_an_engine_without_the_session_routes_is_loaded_as_before(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The CPU engine and SGLang before 0.5.23 answer the end 404: asked once, then never again."""
    old = start_engine("old")
    router = start_router([old.url])
    router.wait_healthy(1)
    for path in ("/ckpt/1", "/ckpt/1b"):
        assert router.client.post("/update_weights_from_disk", json=V1 | {"model_path": path}).status_code == 200
    assert old.weight_version == "1" and old.model_path == "/ckpt/1b" and not old.session_events
