"""Engines enter routing in line with the fleet's generation pause, and never resume requests on part of a version.

An engine the router paused that missed the continue rejoins continued, not holding every request routed to
it; one that joins mid-pause, or was restarted during it, is paused like the rest and continued by the fleet's
continue. One in routing that does not take the fleet's pause is routed nothing until it rejoins: paused once
it takes the pause, or after the continue on the fleet's version, loaded whole. An engine holding some buckets
of a version has the requests it holds sent to other engines and aborted before it is continued, and is not
continued at all if it does not abort them, until it has loaded a whole version; it is restarted only if it
dies, not for probes that wait behind the pause.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse
from router_fakes import GatedEngine, RelaunchingRestarter, RunningRouter, metric_value, port_of, restarter_settings

from rlfleet.errors import Unavailable
from rlfleet_router.busy_engines import BusyEngines
from rlfleet_router.engine_controls import CONTINUE_ROUTE, PAUSE_ROUTE, EngineOutcome
from rlfleet_router.fleet_pause import FleetPause
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.workers import Worker, WorkerRegistry

# Probes every 0.1 s that give up after 0.3 s, two failures in a row take an engine out: a failure window well
# under a second, which the pauses below outlast.
PROBES = {"health_check_timeout_secs": 0.3, "health_failure_threshold": 2}
# rlfleet-engine answers its probes while paused (up to --max-pause); only generation waits.
PROBES_ANSWER_WHILE_PAUSED = ("/generate",)
INIT = {"master_address": "10.0.0.9", "master_port": 29500, "group_name": "g", "backend": "gloo", "world_size": 3}
FIRST_BUCKET = {
    "names": ["w1"],
    "dtypes": ["float32"],
    "shapes": [[2, 2]],
    "group_name": "g",
    "weight_version": None,
    "load_format": "flattened_bucket",
}


@pytest.fixture
def start_gated() -> Iterator[Callable[..., GatedEngine]]:
    started: list[GatedEngine] = []

    def start(name: str, group: bool = False, **attrs: object) -> GatedEngine:
        gated = GatedEngine(name, **attrs)  # type: ignore[arg-type]
        if group:
            add_group_routes(gated)
        started.append(gated.start())
        return gated

    yield start
    for gated in started:
        gated.paused = False  # lets requests still held at it end, so its server stops at once
        assert gated.engine.server is not None
        if gated.engine.server._thread.is_alive():
            gated.engine.server.stop()


def add_group_routes(gated: GatedEngine) -> None:
    """SGLang's weight update group routes, each accepted (a bucket that names a version sets it)."""

    async def init(request: Request) -> JSONResponse:
        return JSONResponse({"success": True, "message": "joined"})

    async def update(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("weight_version") is not None:
            gated.engine.weight_version = str(body["weight_version"])
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy(request: Request) -> JSONResponse:
        return JSONResponse({"success": True, "message": "destroyed"})

    gated.app.add_api_route("/init_weights_update_group", init, methods=["POST"])
    gated.app.add_api_route("/update_weights_from_distributed", update, methods=["POST"])
    gated.app.add_api_route("/destroy_weights_update_group", destroy, methods=["POST"])


def routes(gated: GatedEngine) -> list[str]:
    return [route for route, _, _ in gated.engine.controls]


def served_by(router: RunningRouter, count: int) -> set[str]:
    answers = [router.client.post("/generate", json={"text": str(i)}, timeout=5) for i in range(count)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return {a.json()["meta_info"]["engine"] for a in answers}


def test_an_engine_that_missed_the_continue_rejoins_continued(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    steady = start_gated("steady", gated=PROBES_ANSWER_WHILE_PAUSED)
    victim = start_gated("victim", gated=PROBES_ANSWER_WHILE_PAUSED)
    router = start_router([steady.url, victim.url], **PROBES)
    router.wait_healthy(2)
    load = {"model_path": "/ckpt/1", "weight_version": "1"}
    assert router.client.post("/update_weights_from_disk", json=load).status_code == 200
    victim.engine.healthy = False
    router.wait_for(lambda: not router.workers()[1]["healthy"], what="the victim out of routing")

    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert steady.paused and victim.paused, "a pause reaches engines out of routing too"
    victim.engine.refused_controls = {"/continue_generation"}
    assert router.client.post("/continue_generation", json={}).status_code == 502
    assert not steady.paused and victim.paused

    victim.engine.refused_controls = set()
    victim.engine.healthy = True  # its probes pass, paused as it is: it is let back in, on the fleet's weights
    router.wait_healthy(2)
    assert victim.engine.update_bodies[-1] == load
    assert not victim.paused, "it rejoined routing paused: every request routed to it would wait"
    assert routes(victim)[-1] == "/continue_generation"
    assert served_by(router, 4) == {"steady", "victim"}


def test_an_engine_removed_while_paused_and_added_again_after_the_continue_rejoins_continued(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Added again it is a new worker (another id), but the same engine, still paused by the router."""
    steady = start_gated("steady", gated=PROBES_ANSWER_WHILE_PAUSED)
    victim = start_gated("victim", gated=PROBES_ANSWER_WHILE_PAUSED)
    router = start_router([steady.url, victim.url], **PROBES)
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert router.client.delete(f"/workers/{victim.url}").status_code == 200  # a NotReady pod, dropped
    assert router.client.post("/continue_generation", json={}).status_code == 200
    assert not steady.paused and victim.paused, "a continue reaches only the engines in the fleet"
    time.sleep(0.5)  # health rounds, each forgetting what the router knew of engines no longer in the fleet

    assert router.client.post("/workers", json={"url": victim.url}).status_code == 202
    router.wait_healthy(2)
    assert not victim.paused, "it rejoined routing paused: every request routed to it would wait"
    assert routes(victim)[-1] == "/continue_generation"
    assert served_by(router, 4) == {"steady", "victim"}


def test_an_engine_that_joins_mid_pause_is_paused_with_the_fleet_and_continued_with_it(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    steady = start_gated("steady")
    router = start_router([steady.url], **PROBES)
    router.wait_healthy(1)
    pause = {"mode": "in_place"}
    assert router.client.post("/pause_generation", json=pause).status_code == 200

    newcomer = start_gated("newcomer")
    assert router.client.post("/workers", json={"url": newcomer.url}).status_code == 202
    router.wait_healthy(2)
    assert newcomer.paused, "it joined routing generating while the fleet is paused"
    [(route, content_type, body)] = newcomer.engine.controls
    assert (route, content_type, json.loads(body)) == ("/pause_generation", "application/json", pause)
    time.sleep(1.0)  # several failure windows of probes that wait behind its pause: it is checked for liveness
    assert [w["healthy"] for w in router.workers()] == [True, True]
    exposition = router.client.get("/metrics").text
    assert metric_value(exposition, "rlfleet_router_engine_busy", {"engine": newcomer.url, "reason": "paused"}) == 1

    assert router.client.post("/continue_generation", json={}).status_code == 200
    assert not newcomer.paused and not steady.paused
    assert served_by(router, 4) == {"steady", "newcomer"}


def test_an_engine_that_did_not_take_the_pause_gets_no_request_until_it_rejoins_on_the_fleets_version(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Kept in routing, it answered between two buckets of a version with part of it loaded, under the old label."""
    steady, refuser = start_gated("steady", group=True), start_gated("refuser", group=True)
    router = start_router([steady.url, refuser.url], **PROBES)
    router.wait_healthy(2)
    refuser.engine.refused_controls = {"/pause_generation"}  # that one call fails (503); the engine stays healthy

    assert router.client.post("/pause_generation", json={}).status_code == 502
    assert steady.paused and not refuser.paused
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(router.client.post, "/generate", json={"text": str(i)}, timeout=15) for i in range(4)]
        router.wait_for(
            lambda: sum(int(str(w["in_flight"])) for w in router.workers()) + len(refuser.engine.raw_bodies) == 4,
            what="every request routed",
        )
        assert refuser.engine.raw_bodies == [], "routed to an engine that did not take the fleet's pause"
        time.sleep(0.5)  # rounds of probes that pass: admission sends it the pause again, which it refuses
        assert [w["healthy"] for w in router.workers()] == [True, False]
        assert routes(refuser).count("/pause_generation") > 1

        # The trainer opens its group with the engines in routing and sends a version in two buckets.
        init = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 2})
        assert init.status_code == 200, init.text
        assert [e["url"] for e in init.json()["engines"]] == [steady.url]
        assert router.client.post("/update_weights_from_distributed", json=FIRST_BUCKET).status_code == 200
        last = {**FIRST_BUCKET, "names": ["w2"], "weight_version": "1"}
        assert router.client.post("/update_weights_from_distributed", json=last).status_code == 200
        copy = {"model_path": "/w/1", "weight_version": "1"}
        assert router.client.post("/weight_version/disk_copy", json=copy).status_code == 200
        continued = router.client.post("/continue_generation", json={})
        answers = [future.result() for future in held]

    assert continued.status_code == 200, continued.text
    assert {a.json()["meta_info"]["engine"] for a in answers} == {"steady"}
    router.wait_healthy(2)
    assert refuser.engine.update_bodies == [copy], "it rejoined without loading the fleet's version whole"
    assert served_by(router, 4) == {"steady", "refuser"}
    assert {w["weight_version"] for w in router.workers()} == {"1"}


def test_an_engine_that_did_not_take_the_pause_rejoins_paused_once_it_takes_it(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    steady, refuser = start_gated("steady"), start_gated("refuser")
    router = start_router([steady.url, refuser.url], **PROBES)
    router.wait_healthy(2)
    refuser.engine.refused_controls = {"/pause_generation"}
    pause = {"mode": "retract"}
    assert router.client.post("/pause_generation", json=pause).status_code == 502
    assert [w["healthy"] for w in router.workers()] == [True, False]

    refuser.engine.refused_controls = set()  # the failure was transient: the pause sent as it rejoins lands
    router.wait_healthy(2)
    assert refuser.paused, "it rejoined routing generating while the fleet is paused"
    route, _, body = refuser.engine.controls[-1]
    assert (route, json.loads(body)) == ("/pause_generation", pause)

    assert router.client.post("/continue_generation", json={}).status_code == 200
    assert not refuser.paused and not steady.paused
    assert served_by(router, 4) == {"steady", "refuser"}


def test_an_engine_restarted_during_a_pause_rejoins_paused(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The healer keeps the worker (its id) but not the process: the router's record that it took the pause made
    the restarted engine, not paused, rejoin generating while the fleet is paused."""
    steady = start_gated("steady", gated=PROBES_ANSWER_WHILE_PAUSED)
    victim = start_gated("victim", gated=PROBES_ANSWER_WHILE_PAUSED)
    restarted: list[GatedEngine] = []
    restarter = RelaunchingRestarter(
        lambda url: restarted.append(start_gated("victim", gated=PROBES_ANSWER_WHILE_PAUSED, port=port_of(url)))
    )
    router = start_router([steady.url, victim.url], **PROBES, **restarter_settings(monkeypatch, restarter))
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200

    assert victim.engine.server is not None
    victim.engine.server.stop()  # dies mid-pause
    router.wait_for(lambda: bool(restarted), what="the victim restarted")
    router.wait_healthy(2)
    assert restarted[0].paused, "it rejoined routing generating while the fleet is paused"
    assert routes(restarted[0]) == ["/pause_generation"]

    assert router.client.post("/continue_generation", json={}).status_code == 200
    assert not restarted[0].paused and not steady.paused
    assert served_by(router, 4) == {"steady", "victim"}


def test_a_group_member_that_died_is_restarted_and_one_paused_holding_part_of_a_version_is_not(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stranded by the broken group (taken out, not failed out), the dead member was never restarted. The live one
    waits, paused, for the trainer's disk fallback: its probes wait behind the pause, which is no failure."""
    lives, dies = start_gated("lives", group=True), start_gated("dies", group=True)
    restarted: list[GatedEngine] = []
    restarter = RelaunchingRestarter(lambda url: restarted.append(start_gated("dies", group=True, port=port_of(url))))
    router = start_router([lives.url, dies.url], **PROBES, **restarter_settings(monkeypatch, restarter))
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert router.client.post("/init_weights_update_group", json=INIT).status_code == 200

    assert dies.engine.server is not None
    dies.engine.server.stop()
    # The bucket fails: 502 at the dead member, or 409 when its probes (0.1 s apart) took it out first, as they did
    # on a loaded machine; either way the group is broken and the member out of routing, which is what follows.
    assert router.client.post("/update_weights_from_distributed", json=FIRST_BUCKET).status_code in (502, 409)
    router.wait_for(lambda: bool(restarted), what="the dead member restarted")
    time.sleep(1.0)  # many failure windows of probes of the live member, waiting behind its pause
    assert restarter.restarts == [dies.url]
    assert lives.paused and [w["restarting"] for w in router.workers()] == [False, False]

    fallback = {"model_path": "/w/1", "weight_version": "1"}
    assert router.client.post("/update_weights_from_disk", json=fallback).status_code == 200
    router.wait_healthy(2)
    assert lives.engine.weight_version == restarted[0].engine.weight_version == "1"


def test_requests_held_by_an_engine_with_part_of_a_version_go_to_another_before_it_is_continued(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    members = [start_gated(name, group=True) for name in "ab"]
    router = start_router([e.url for e in members], **PROBES)
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert router.client.post("/init_weights_update_group", json=INIT).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=FIRST_BUCKET).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        held = [
            pool.submit(router.client.post, "/generate", json={"text": "x", "rid": f"r-{i}"}, timeout=15)
            for i in range(2)
        ]
        router.wait_for(lambda: sum(int(str(w["in_flight"])) for w in router.workers()) == 2, what="a request at each")
        whole = start_gated("whole")  # joins after the group opened: it holds no bucket
        assert router.client.post("/workers", json={"url": whole.url}).status_code == 202
        router.wait_healthy(3)

        continued = router.client.post("/continue_generation", json={})
        answers = [future.result() for future in held]

    assert continued.status_code == 200, continued.text
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert {a.json()["meta_info"]["engine"] for a in answers} == {"whole"}, "answered by an engine on mixed weights"
    assert [w["healthy"] for w in router.workers()] == [False, False, True]
    for member in members:
        sent = [(route, json.loads(body or b"null")) for route, _, body in member.engine.controls]
        assert ("/abort_request", {"abort_all": True}) in sent, "it was continued holding its requests"
        abort_all = sent.index(("/abort_request", {"abort_all": True}))
        assert sent.index(("/continue_generation", {})) > abort_all, "continued before its requests were aborted"


def test_an_engine_with_part_of_a_version_that_does_not_abort_stays_paused_until_it_loads_a_whole_one(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    refuses, takes = start_gated("refuses", group=True), start_gated("takes", group=True)
    router = start_router([refuses.url, takes.url], **PROBES)
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert router.client.post("/init_weights_update_group", json=INIT).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=FIRST_BUCKET).status_code == 200
    refuses.engine.refused_controls = {"/abort_request"}  # an engine that cannot abort everything it runs

    continued = router.client.post("/continue_generation", json={})
    assert continued.status_code == 502, continued.text
    by_url = {e["url"]: e for e in continued.json()["engines"]}
    assert by_url[takes.url]["status"] == 200
    assert by_url[refuses.url]["status"] is None and "not continued" in by_url[refuses.url]["message"]
    assert refuses.paused and not takes.paused
    assert "/continue_generation" not in routes(refuses)

    # The disk fallback of the version loads both whole; the one still paused is continued as it rejoins.
    fallback = {"model_path": "/w/2", "weight_version": "2"}
    assert router.client.post("/update_weights_from_disk", json=fallback).status_code == 200
    assert [w["healthy"] for w in router.workers()] == [True, True]
    assert not refuses.paused and routes(refuses)[-1] == "/continue_generation"
    assert served_by(router, 4) == {"refuses", "takes"}


def test_an_engine_with_part_of_a_version_whose_fallback_load_failed_does_not_rejoin_on_it(
    start_gated: Callable[..., GatedEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """No version was ever loaded through the router, so an engine rejoins on what it reports: unless it may hold
    part of one, which a failed load into it did not change."""
    members = [start_gated(name, group=True) for name in "ab"]
    router = start_router([e.url for e in members], **PROBES)
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert router.client.post("/init_weights_update_group", json=INIT).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=FIRST_BUCKET).status_code == 200
    assert router.client.post("/continue_generation", json={}).status_code == 200
    for member in members:
        member.engine.fail_updates = True
    fallback = {"model_path": "/w/2", "weight_version": "2"}
    assert router.client.post("/update_weights_from_disk", json=fallback).json()["success"] is False
    for member in members:
        member.engine.fail_updates = False

    time.sleep(1.0)  # many successful probes: an engine not known to hold part of a version would be back
    assert [w["healthy"] for w in router.workers()] == [False, False]
    assert router.client.post("/update_weights_from_disk", json=fallback).status_code == 200
    assert [w["healthy"] for w in router.workers()] == [True, True]


def test_an_engine_matched_to_the_pause_before_it_changed_is_matched_again() -> None:
    async def scenario() -> None:
        registry = WorkerRegistry(failure_threshold=2, success_threshold=2)
        busy = BusyEngines(60.0, RouterMetrics(registry, lambda: None).registry, registry)
        async with httpx.AsyncClient(trust_env=False) as client:
            pauses = FleetPause(client, busy, timeout_secs=1.0)
            worker = Worker(url="http://127.0.0.1:9")  # never sent anything: the router never paused it
            turn = await pauses.match(worker)
            refused = pauses.begin([Worker(url="http://127.0.0.1:10")], b"{}", {})
            assert not pauses.joins(worker, turn), "a pause began after it was matched"
            assert pauses.paused() and pauses.turn == turn + 1

            pauses.end(refused)  # no engine took it
            assert not pauses.paused()
            again = pauses.begin([], b"{}", {})
            pauses.end(refused)  # an older pause's ending leaves the current one alone
            assert pauses.paused()
            pauses.end(again)
            assert not pauses.paused()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_a_removed_engine_is_remembered_by_url_until_a_continue_reaches_it_or_its_pause_stops_counting() -> None:
    async def scenario() -> None:
        registry = WorkerRegistry(failure_threshold=2, success_threshold=2)
        busy = BusyEngines(0.3, RouterMetrics(registry, lambda: None).registry, registry)
        async with httpx.AsyncClient(trust_env=False) as client:
            pauses = FleetPause(client, busy, timeout_secs=1.0)

            def removed_while_paused(url: str) -> None:
                engine = Worker(url=url)
                pauses.begin([engine], b"{}", {})
                pauses.record(PAUSE_ROUTE, [EngineOutcome(engine, 200, "paused")])
                pauses.removed(engine)
                pauses.end()

            # Nothing listens on these ports: a continue sent there is not taken (Unavailable).
            removed_while_paused("http://127.0.0.1:9")
            with pytest.raises(Unavailable, match="/continue_generation"):
                await pauses.match(Worker(url="http://127.0.0.1:9"))
            await pauses.match(Worker(url="http://127.0.0.1:10"))  # never paused by the router: nothing sent

            removed_while_paused("http://127.0.0.1:11")
            pauses.record(CONTINUE_ROUTE, [EngineOutcome(Worker(url="http://127.0.0.1:11"), 200, "continued")])
            await pauses.match(Worker(url="http://127.0.0.1:11"))

            removed_while_paused("http://127.0.0.1:12")
            await asyncio.sleep(0.4)
            pauses.keep_only([])
            assert not pauses._removed, "removed engines remembered past the pause bound"
            await pauses.match(Worker(url="http://127.0.0.1:12"))

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
