"""Weight updates: fan-out to the fleet, the recorded version, and engines joining on that version."""

from __future__ import annotations

import time
from collections.abc import Callable

from router_fakes import FakeEngine, RunningRouter

from rlfleet_router.weights import empties_cache


def test_update_reaches_every_engine_and_records_the_version(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engines = [start_engine(name, update_delay=0.3) for name in "abc"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(3)
    assert router.client.get("/weight_version").json() == {"weight_version": None, "model_path": None}

    start = time.monotonic()
    answer = router.client.post(
        "/update_weights_from_disk", json={"model_path": "/ckpt/step-1", "weight_version": 1, "flush_cache": True}
    )
    elapsed = time.monotonic() - start
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["success"] is True and result["weight_version"] == "1"
    assert sorted(r["url"] for r in result["engines"]) == sorted(e.url for e in engines)
    assert all(r["success"] for r in result["engines"])
    assert elapsed < 0.8, "engines load concurrently, not one after another"
    for engine in engines:
        assert engine.weight_version == "1" and engine.model_path == "/ckpt/step-1"
        assert engine.update_bodies[-1]["flush_cache"] is True, "fields the router does not model reach engines"
        assert engine.update_bodies[-1]["weight_version"] == "1", "SGLang's weight_version is a string"
    assert router.client.get("/weight_version").json() == {"weight_version": "1", "model_path": "/ckpt/step-1"}
    fleet = router.client.get("/fleet").json()
    assert fleet["weight_version"] == "1" and fleet["healthy"] == 3
    assert {w["weight_version"] for w in fleet["workers"]} == {"1"}


def test_new_worker_loads_the_fleet_version_before_it_takes_traffic(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    old = start_engine("old")
    router = start_router([old.url])
    router.wait_healthy(1)
    update = {"model_path": "/ckpt/step-5", "weight_version": "5"}
    assert router.client.post("/update_weights_from_disk", json=update).json()["success"] is True

    late = start_engine("late", weight_version="0", update_delay=0.5)
    assert router.client.post("/workers", json={"url": late.url}).status_code == 202
    # Keep traffic flowing while the newcomer loads weights: none of it may reach the newcomer early.
    deadline = time.monotonic() + 10
    while "generate" not in late.events:
        assert time.monotonic() < deadline, f"new worker never served: {router.workers()}"
        assert router.client.post("/generate", json={"text": "x"}).status_code == 200
    assert late.events[0] == "update", f"served before loading the fleet's weights: {late.events}"
    assert late.weight_version == "5" and late.update_bodies == [update]
    assert all(w["weight_version"] == "5" for w in router.workers())


def test_engine_failing_an_update_leaves_routing_and_rejoins_on_the_new_version(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    good, bad = start_engine("good"), start_engine("bad", fail_updates=True)
    router = start_router([good.url, bad.url], health_success_threshold=2)
    router.wait_healthy(2)

    answer = router.client.post("/update_weights_from_disk", json={"model_path": "/ckpt/2", "weight_version": "2"})
    assert answer.status_code == 502
    result = answer.json()
    assert result["success"] is False and result["weight_version"] == "2"
    failed = next(r for r in result["engines"] if r["url"] == bad.url)
    assert failed["success"] is False and "cannot read checkpoint" in failed["message"]
    assert router.client.get("/weight_version").json()["weight_version"] == "2"
    assert {w["url"] for w in router.workers() if w["healthy"]} == {good.url}
    for _ in range(3):
        assert router.client.post("/generate", json={"text": "x"}).json()["meta_info"]["weight_version"] == "2"

    bad.fail_updates = False
    router.wait_healthy(2)
    assert bad.weight_version == "2"


def test_update_that_every_engine_fails_keeps_the_old_version(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    assert router.client.post(
        "/update_weights_from_disk", json={"model_path": "/c/1", "weight_version": "1"}
    ).is_success
    engine.fail_updates = True
    answer = router.client.post("/update_weights_from_disk", json={"model_path": "/c/2", "weight_version": "2"})
    # Every engine refused it (400, as SGLang answers a load it cannot do): a 502 made the trainer send the same
    # load to the whole fleet again and again for minutes.
    assert answer.status_code == 400 and answer.json()["weight_version"] == "1"
    assert answer.json()["message"] == "no engine loaded weight version '2'; the fleet still serves '1'"
    assert router.client.get("/weight_version").json()["weight_version"] == "1"
    assert router.workers()[0]["healthy"] is True, "the engine still serves the fleet's version"


def test_a_first_load_every_engine_refuses_says_the_fleet_has_no_version_yet(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a", fail_updates=True)
    router = start_router([engine.url])
    router.wait_healthy(1)
    answer = router.client.post("/update_weights_from_disk", json={"model_path": "/c/1", "weight_version": "1"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["message"] == "no engine loaded weight version '1'; the fleet still serves no version yet"


def test_bad_update_requests_are_4xx_and_no_engine_is_503(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    missing = router.client.post("/update_weights_from_disk", json={"weight_version": "1"})
    assert missing.status_code == 400 and "model_path" in missing.json()["error"]["message"]
    empty = router.client.post("/update_weights_from_disk", json={"model_path": "/c", "weight_version": ""})
    assert empty.status_code == 400 and "weight_version" in empty.json()["error"]["message"]
    assert engine.update_bodies == []

    router.client.delete(f"/workers/{router.workers()[0]['id']}")
    none = router.client.post("/update_weights_from_disk", json={"model_path": "/c", "weight_version": "1"})
    assert none.status_code == 503 and "no healthy engine" in none.json()["error"]["message"]


def test_which_weight_requests_leave_an_engine_cache_empty() -> None:
    assert empties_cache("/update_weights_from_disk", b'{"model_path": "/ckpt/1"}')
    assert not empties_cache("/update_weights_from_disk", b'{"model_path": "/ckpt/1", "flush_cache": false}')
    assert empties_cache("/update_weights_from_distributed", b'{"names": ["w"]}'), "SGLang flushes by default"
    assert not empties_cache("/update_weights_from_distributed", b'{"names": ["w"], "flush_cache": false}')
    assert not empties_cache("/init_weights_update_group", b"{}")


def test_a_retried_version_is_not_a_newer_one_for_cached_trajectories(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A partial update answers 502 and the trainer retries the same version: that is one version, not two, so
    a trajectory sampled on the version before it is still within `--trajectory-max-update-lag` (1)."""
    good, bad = start_engine("good"), start_engine("bad")
    router = start_router([good.url, bad.url], trajectory_max_update_lag=1)
    router.wait_healthy(2)
    v1, v2 = {"model_path": "/c/1", "weight_version": "1"}, {"model_path": "/c/2", "weight_version": "2"}
    assert router.client.post("/update_weights_from_disk", json=v1).status_code == 200
    turn = {"input_ids": [1, 2], "return_logprob": True}
    assert router.client.post("/generate", json=turn, headers={"x-rlfleet-trajectory-id": "t"}).status_code == 200
    # The fake engine's answer holds no tokens: the turn is recorded as lost, which GET reports as 409.
    assert router.client.get("/trajectories/t").status_code == 409

    bad.fail_updates = True
    assert router.client.post("/update_weights_from_disk", json=v2).status_code == 502
    assert router.client.post("/update_weights_from_disk", json=v2).status_code == 200  # the trainer's retry
    assert router.client.get("/trajectories/t").status_code == 409, "evicted as two updates old"
    assert router.client.post("/update_weights_from_disk", json={**v2, "weight_version": "3"}).status_code == 200
    assert router.client.get("/trajectories/t").status_code == 404
