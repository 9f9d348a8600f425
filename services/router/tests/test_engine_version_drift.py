"""An engine in routing that serves another weight version than the router recorded (it restarted by itself
faster than the failure window, on its initial weights) leaves routing and loads the fleet's version before
it serves again, paused like the fleet if the fleet is paused."""

from __future__ import annotations

from collections.abc import Callable

from router_fakes import FakeEngine, GatedEngine, RunningRouter, ThreadedServer, metric_value, port_of


def test_an_engine_restarted_within_the_failure_window_reloads_the_fleet_version(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    steady, victim = start_engine("steady"), start_engine("victim")
    # No probe failure is needed to notice: the restart is quicker than 50 failed probes in a row.
    router = start_router([steady.url, victim.url], health_failure_threshold=50)
    router.wait_healthy(2)
    body = {"model_path": "/ckpt/1", "weight_version": "1"}
    assert router.client.post("/update_weights_from_disk", json=body).status_code == 200

    assert victim.server is not None
    victim.server.stop()
    restarted = FakeEngine(name="victim")  # back on its initial weights, version "0"
    restarted.server = ThreadedServer(restarted.app(), port=victim.server.port).start()
    try:
        router.wait_for(lambda: restarted.weight_version == "1", what="the restarted engine reloaded version 1")
        router.wait_healthy(2)
        assert [b["weight_version"] for b in restarted.update_bodies] == ["1"]
        assert {w["weight_version"] for w in router.workers()} == {"1"}
        served = {
            router.client.post("/generate", json={"text": str(i)}).json()["meta_info"]["weight_version"]
            for i in range(6)
        }
        assert served == {"1"}
        exposition = router.client.get("/metrics").text
        assert metric_value(exposition, "rlfleet_router_engine_version_drifts_total", {"engine": victim.url}) == 1
        assert steady.update_bodies == [body], "the engine that stayed on the fleet's version is left alone"
    finally:
        restarted.server.stop()


def test_an_engine_restarted_by_itself_during_a_pause_reloads_the_fleet_version_and_is_paused(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A paused engine is checked for liveness only, and its version was not compared: one that restarted by itself
    served its boot weights, not paused, for as long as the fleet's pause lasted."""
    steady, victim = start_engine("steady"), start_engine("victim")
    router = start_router([steady.url, victim.url], health_failure_threshold=50)
    router.wait_healthy(2)
    body = {"model_path": "/ckpt/1", "weight_version": "1"}
    assert router.client.post("/update_weights_from_disk", json=body).status_code == 200
    assert router.client.post("/pause_generation", json={}).status_code == 200

    assert victim.server is not None
    victim.server.stop()
    restarted = GatedEngine("victim", port=port_of(victim.url)).start()  # its boot weights, and not paused
    try:
        router.wait_for(lambda: restarted.engine.weight_version == "1", what="the restarted engine reloaded version 1")
        router.wait_healthy(2)
        assert [b["weight_version"] for b in restarted.engine.update_bodies] == ["1"]
        assert restarted.paused, "it rejoined routing generating while the fleet is paused"
        exposition = router.client.get("/metrics").text
        assert metric_value(exposition, "rlfleet_router_engine_version_drifts_total", {"engine": victim.url}) == 1
        assert router.client.post("/continue_generation", json={}).status_code == 200
        assert not restarted.paused
    finally:
        restarted.paused = False
        assert restarted.engine.server is not None
        restarted.engine.server.stop()


def test_an_engine_that_cannot_load_the_fleet_version_shows_the_version_it_serves(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """/workers and rlfleet_router_engine_weight_version showed the fleet's version for an engine back on its boot
    weights for as long as it stayed out of routing."""
    steady, victim = start_engine("steady"), start_engine("victim")
    router = start_router([steady.url, victim.url], health_failure_threshold=50)
    router.wait_healthy(2)
    body = {"model_path": "/ckpt/1", "weight_version": "1"}
    assert router.client.post("/update_weights_from_disk", json=body).status_code == 200

    assert victim.server is not None
    victim.server.stop()
    restarted = FakeEngine(name="victim", fail_updates=True)  # on its initial weights, version "0", for good
    restarted.server = ThreadedServer(restarted.app(), port=victim.server.port).start()
    try:
        router.wait_for(lambda: bool(restarted.update_bodies), what="the restarted engine was asked to load version 1")

        def shown() -> tuple[object, float | None]:
            worker = next(w for w in router.workers() if w["url"] == victim.url)
            exposition = router.client.get("/metrics").text
            return worker["weight_version"], metric_value(
                exposition, "rlfleet_router_engine_weight_version", {"engine": victim.url}
            )

        router.wait_for(lambda: shown() == ("0", 0.0), what="the engine's own version 0 shown")
        assert next(w for w in router.workers() if w["url"] == victim.url)["state"] != "healthy"
    finally:
        restarted.server.stop()


def test_what_an_engine_serves_is_read_from_model_info_or_where_its_sglang_has_it(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang 0.5.23 logs /get_model_info as deprecated at every call, which the router made every health round,
    and will drop it: /model_info is asked first, and an engine without it (404: an older SGLang) keeps its own."""
    current = start_engine("current", info_routes=("/model_info", "/get_model_info"))
    older = start_engine("older")  # /get_model_info only
    later = start_engine("later", info_routes=("/model_info",))
    router = start_router([current.url, older.url, later.url])
    router.wait_healthy(3)
    load = {"model_path": "/c/1", "weight_version": "1"}
    assert router.client.post("/update_weights_from_disk", json=load).is_success
    router.wait_for(lambda: all(len(e.info_calls) >= 6 for e in (current, older, later)), what="health rounds")
    assert set(current.info_calls) == {"/model_info"} and set(later.info_calls) == {"/model_info"}
    assert older.info_calls[:2] == ["/model_info", "/get_model_info"]
    assert set(older.info_calls[2:]) == {"/get_model_info"}, "asked where it answers, once found"
    assert {w["weight_version"] for w in router.workers()} == {"1"} and all(w["healthy"] for w in router.workers())
