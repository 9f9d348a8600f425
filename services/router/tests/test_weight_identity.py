"""An engine serves in routing only the weights the router saw it load, never on a version label alone.

Labels repeat: the trainer loads a run's model as version "0", engines boot as "0", and one run's "2" is not
another's. Each case below had an engine serve other weights than the fleet's under the fleet's label.
"""

from __future__ import annotations

from collections.abc import Callable

from router_fakes import FakeEngine, RunningRouter, ThreadedServer, metric_value


def load(router: RunningRouter, model_path: str, version: str) -> None:
    answer = router.client.post("/update_weights_from_disk", json={"model_path": model_path, "weight_version": version})
    assert answer.status_code == 200, answer.text


def restart(engine: FakeEngine) -> FakeEngine:
    """A new process on `engine`'s port, on its boot weights (version "0" from /models/initial)."""
    assert engine.server is not None
    engine.server.stop()
    restarted = FakeEngine(name=engine.name)
    restarted.server = ThreadedServer(restarted.app(), port=engine.server.port).start()
    return restarted


def test_an_engine_restarted_on_its_boot_weights_loads_the_runs_model_served_under_the_same_label(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    steady, victim = start_engine("steady"), start_engine("victim")
    router = start_router([steady.url, victim.url])
    router.wait_healthy(2)
    # Nothing loaded yet: engines join on what they report, and nothing is sent to them.
    assert {w["weight_version"] for w in router.workers()} == {"0"} and victim.update_bodies == []

    load(router, "/ckpt/sft", "0")  # the run starts from another model than the engines boot with
    assert victim.server is not None
    victim.server.stop()
    router.wait_for(lambda: not router.workers()[1]["healthy"], what="the crashed engine out of routing")
    restarted = restart(victim)
    try:
        router.wait_healthy(2)
        assert restarted.update_bodies == [{"model_path": "/ckpt/sft", "weight_version": "0"}]
        assert restarted.events[0] == "update", "it served before it loaded the fleet's weights"
        assert router.workers()[1]["model_path"] == "/ckpt/sft"
    finally:
        assert restarted.server is not None
        restarted.server.stop()


def test_a_hung_engine_back_after_another_run_reached_its_label_loads_that_runs_weights(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    steady, hung = start_engine("steady"), start_engine("hung")
    router = start_router([steady.url, hung.url])
    router.wait_healthy(2)
    load(router, "/runs/a/2", "2")
    hung.healthy = False  # out of routing, holding run A's version 2
    router.wait_for(lambda: not router.workers()[1]["healthy"], what="the hung engine out of routing")
    load(router, "/models/initial", "0")  # run B starts ...
    load(router, "/runs/b/2", "2")  # ... and reaches its own version 2

    hung.healthy = True
    router.wait_healthy(2)
    assert hung.update_bodies[-1] == {"model_path": "/runs/b/2", "weight_version": "2"}
    assert hung.model_path == "/runs/b/2"
    served = {router.client.post("/generate", json={"text": str(i)}).json()["meta_info"]["engine"] for i in range(4)}
    assert served == {"steady", "hung"}


def test_an_engine_restarted_within_the_failure_window_under_the_fleets_label_reloads(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """No probe fails (50 would have to): the health round finds the engine reporting its boot model's path."""
    steady, victim = start_engine("steady"), start_engine("victim")
    router = start_router([steady.url, victim.url], health_failure_threshold=50)
    router.wait_healthy(2)
    load(router, "/ckpt/sft", "0")

    restarted = restart(victim)
    try:
        router.wait_for(lambda: restarted.model_path == "/ckpt/sft", what="the restarted engine reloaded the model")
        router.wait_healthy(2)
        assert restarted.update_bodies == [{"model_path": "/ckpt/sft", "weight_version": "0"}]
        exposition = router.client.get("/metrics").text
        assert metric_value(exposition, "rlfleet_router_engine_version_drifts_total", {"engine": victim.url}) == 1
        assert steady.update_bodies == [{"model_path": "/ckpt/sft", "weight_version": "0"}]
    finally:
        assert restarted.server is not None
        restarted.server.stop()
