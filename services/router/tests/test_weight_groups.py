"""The router's side of the distributed weight path, against fake engines (no tensors travel here).

What the router must get right: which engines form the group and with which ranks, refusing a
group that cannot form before any engine blocks in it, fanning each bucket out, recording the
version the last bucket carries, taking out engines that fail, and re-admitting engines only on a
registered disk copy of a version that arrived over the group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse
from router_fakes import (
    FakeEngine,
    RelaunchingRestarter,
    RunningRouter,
    ThreadedServer,
    metric_value,
    port_of,
    restarter_settings,
)

from rlfleet_router import distributed_weights


@dataclass
class GroupEngine:
    """A fake engine that also answers SGLang's distributed weight endpoints, recording each body."""

    engine: FakeEngine
    inits: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    destroys: list[dict[str, Any]] = field(default_factory=list)  # of groups it held
    ended: list[str] = field(default_factory=list)  # "update" (answered) and "destroy", in order
    # The groups it holds: as SGLang, it refuses to create one under a name it holds, and to destroy one it does not.
    held: set[str] = field(default_factory=set)
    fail_updates: bool = False
    # As rlfleet-engine when some parameter of the version never came: takes the bucket carrying the version, but
    # keeps its old label and says it holds part of one.
    incomplete: bool = False
    update_delay: float = 0.0
    fail_init: bool = False

    @property
    def url(self) -> str:
        return self.engine.url

    # As SGLang 0.5.23 on: buckets only inside a weight-update session (the fake engine's, whose "begin" and "end"
    # join `ended` as answered).
    @property
    def sessions(self) -> bool:
        return self.engine.sessions

    @sessions.setter
    def sessions(self, value: bool) -> None:
        self.engine.sessions = value

    @property
    def session_open(self) -> bool:
        return self.engine.session_open

    @session_open.setter
    def session_open(self, value: bool) -> None:
        self.engine.session_open = value


@pytest.fixture
def start_group_engine() -> Iterator[Callable[..., GroupEngine]]:
    started: list[ThreadedServer] = []

    def start(name: str, port: int | None = None, sessions: bool = False) -> GroupEngine:
        fake = GroupEngine(FakeEngine(name=name, sessions=sessions))
        fake.engine.session_events = fake.ended  # one record of the session, the buckets and the destroys
        app = fake.engine.app()

        @app.post("/init_weights_update_group")
        async def init(request: Request) -> JSONResponse:
            body = await request.json()
            if fake.fail_init:
                refusal = "Failed to initialize custom process group: timed out waiting for the rendezvous."
                return JSONResponse({"success": False, "message": refusal}, status_code=400)
            if body["group_name"] in fake.held:
                refusal = (
                    "Failed to initialize custom process group: The specified group name has already been created, "
                    "please use a different group name."
                )
                return JSONResponse({"success": False, "message": refusal}, status_code=400)
            fake.inits.append(body)
            fake.held.add(body["group_name"])
            return JSONResponse({"success": True, "message": "joined"})

        @app.post("/update_weights_from_distributed")
        async def update(request: Request) -> JSONResponse:
            body = await request.json()
            if fake.sessions and not fake.session_open:
                refusal = (
                    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
                )
                return JSONResponse({"success": False, "message": refusal}, status_code=400)
            fake.updates.append(body)
            await asyncio.sleep(fake.update_delay)
            fake.ended.append("update")
            if fake.fail_updates:
                return JSONResponse({"success": False, "message": "broadcast timed out"}, status_code=503)
            # As rlfleet-engine: until a version's last bucket, it reports holding part of one.
            partial = body.get("weight_version") is None or fake.incomplete
            fake.engine.weights_partial = partial
            if not partial:
                fake.engine.weight_version = str(body["weight_version"])
            message = "Succeeded to update parameter online."
            return JSONResponse({"success": True, "message": message, "weights_partial": partial})

        @app.post("/destroy_weights_update_group")
        async def destroy(request: Request) -> JSONResponse:
            body = await request.json()
            if body["group_name"] not in fake.held:
                refusal = "The group to be destroyed does not exist."
                return JSONResponse({"success": False, "message": refusal}, status_code=400)
            fake.held.remove(body["group_name"])
            fake.destroys.append(body)
            fake.ended.append("destroy")
            return JSONResponse({"success": True, "message": "destroyed"})

        fake.engine.server = ThreadedServer(app, port=port).start()
        started.append(fake.engine.server)
        return fake

    yield start
    for server in started:
        server.stop()


INIT = {"master_address": "10.0.0.9", "master_port": 29500, "group_name": "g", "backend": "gloo"}


def bucket(names: list[str], version: str | int | None = None) -> dict[str, object]:
    return {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [[2, 2]] * len(names),
        "group_name": "g",
        "weight_version": version,
        "load_format": "flattened_bucket",
    }


def test_group_ranks_buckets_and_the_version_they_carry(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engines = [start_group_engine(n) for n in "abc"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(3)

    wrong = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3})
    assert wrong.status_code == 409 and "world_size" in wrong.json()["error"]["message"]
    assert all(not e.inits for e in engines), "a group that cannot form is refused before any engine joins"

    opened = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 4, "rank_offset": 7})
    assert opened.status_code == 200, opened.text
    ranks = {e.url: e.inits[0]["rank_offset"] for e in engines}
    assert sorted(ranks.values()) == [1, 2, 3]
    assert {r["url"]: r["rank_offset"] for r in opened.json()["engines"]} == ranks
    for engine in engines:
        assert {k: engine.inits[0][k] for k in INIT} == INIT and engine.inits[0]["world_size"] == 4
    assert router.client.get("/weights_update_groups/g").json()["current"] is True

    first = router.client.post("/update_weights_from_distributed", json=bucket(["w1", "w2"]))
    assert first.status_code == 200 and first.json()["weight_version"] is None
    last = router.client.post("/update_weights_from_distributed", json=bucket(["w3"], version=4) | {"extra": 1})
    assert last.status_code == 200, last.text
    for engine in engines:
        assert [u["names"] for u in engine.updates] == [["w1", "w2"], ["w3"]]
        assert engine.updates[1]["weight_version"] == "4" and engine.updates[1]["extra"] == 1
    assert router.client.get("/weight_version").json() == {"weight_version": "4", "model_path": None}
    assert {w["weight_version"] for w in router.workers()} == {"4"}
    exposition = router.client.get("/metrics").text
    assert metric_value(exposition, "rlfleet_router_weight_sync_seconds_count", {"path": "distributed"}) == 1
    assert metric_value(exposition, "rlfleet_router_weight_updates_total", {"result": "success"}) == 1

    assert router.client.post("/destroy_weights_update_group", json={"group_name": "g"}).status_code == 200
    assert all(e.destroys == [{"group_name": "g"}] for e in engines)
    assert router.client.get("/weights_update_groups/g").status_code == 404


def test_a_group_left_on_the_engines_is_dropped_before_the_name_opens_again(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A trainer that died without destroying its group (or a router restarted since) leaves the engines holding
    it; SGLang refuses to create a group under a name it holds, so every later open failed and each version went
    to disk. An open that fails on one engine leaves none holding the name either."""
    engines = [start_group_engine(n) for n in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    assert all(e.held == {"g"} for e in engines)

    reopened = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3})
    assert reopened.status_code == 200, reopened.text
    assert all(len(e.inits) == 2 and e.destroys == [{"group_name": "g"}] and e.held == {"g"} for e in engines)

    engines[1].fail_init = True
    failed = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3})
    assert failed.status_code == 502
    deadline = time.monotonic() + 10
    while engines[0].held:
        assert time.monotonic() < deadline, "the engine that joined the failed group still holds it"
        time.sleep(0.05)
    engines[1].fail_init = False
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200


def test_a_failed_bucket_strands_every_member_not_holding_the_version_until_a_disk_load(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The member not waited for may hold the version's last bucket, or not, or (a version in several buckets)
    some of them: it must not serve on its old recorded version. The trainer's disk fallback of the version
    reaches every stranded member, though its probes could not pass (generation is paused) to rejoin."""
    good, bad = start_group_engine("good"), start_group_engine("bad")
    router = start_router([good.url, bad.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    bad.fail_updates = True
    good.update_delay = 0.5  # still receiving when the other member fails

    answer = router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="2"))
    assert answer.status_code == 502 and answer.json()["success"] is False
    assert [w["healthy"] for w in router.workers()] == [False, False]
    assert all("part of a weight version" in str(w["last_error"]) for w in router.workers())
    assert router.client.get("/weight_version").json()["weight_version"] is None
    again = router.client.post("/update_weights_from_distributed", json=bucket(["w"]))
    assert again.status_code == 404 and "init_weights_update_group" in again.json()["error"]["message"]

    router.wait_for(lambda: good.ended == ["update", "destroy"], what="good's bucket ended, then the group destroyed")
    fallback = router.client.post("/update_weights_from_disk", json={"model_path": "/w/v2", "weight_version": "2"})
    assert fallback.status_code == 200, fallback.text
    assert sorted(r["url"] for r in fallback.json()["engines"]) == sorted([good.url, bad.url])
    assert [w["healthy"] for w in router.workers()] == [True, True]
    assert {w["weight_version"] for w in router.workers()} == {"2"}


def test_a_member_that_takes_the_last_bucket_but_holds_part_of_the_version_is_stranded_as_if_it_failed(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """rlfleet-engine takes a labelled bucket that does not complete the version (SGLang's contract) and answers
    success with `weights_partial: true` under its old label: for the fleet that member did not take the version
    (a tensor lost, or left out by the trainer), so the trainer gets 502 and its disk fallback loads it whole."""
    whole, short = start_group_engine("whole"), start_group_engine("short")
    router = start_router([whole.url, short.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w1"])).status_code == 200
    short.incomplete = True

    answer = router.client.post("/update_weights_from_distributed", json=bucket(["w2"], version="2"))
    assert answer.status_code == 502 and answer.json()["success"] is False, answer.text
    results = {r["url"]: r for r in answer.json()["engines"]}
    assert results[whole.url]["success"] is True
    assert results[short.url]["success"] is False and "part of" in results[short.url]["message"], results
    assert [(w["url"], w["healthy"]) for w in router.workers()] == [(whole.url, True), (short.url, False)]
    assert "part of a weight version" in str(router.workers()[1]["last_error"])
    exposition = router.client.get("/metrics").text
    assert metric_value(exposition, "rlfleet_router_weight_updates_total", {"result": "partial"}) == 1
    assert router.client.get("/weights_update_groups/g").status_code == 404, "the group is closed"

    router.wait_for(lambda: short.ended == ["update", "update", "destroy"], what="the group destroyed on it")
    fallback = router.client.post("/update_weights_from_disk", json={"model_path": "/w/v2", "weight_version": "2"})
    assert fallback.status_code == 200, fallback.text
    assert short.url in [r["url"] for r in fallback.json()["engines"]]
    assert [w["healthy"] for w in router.workers()] == [True, True]
    assert {w["weight_version"] for w in router.workers()} == {"2"} and short.engine.weights_partial is False


def test_a_group_the_router_closed_is_destroyed_on_its_engines(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The trainer forgets a group whose broadcast failed: the router destroys it on the engines, each once its
    bucket has ended (a destroy behind a pending collective would wait for it), and a destroy from the trainer
    after that is answered, not a 404."""
    slow, bad = start_group_engine("slow"), start_group_engine("bad")
    router = start_router([slow.url, bad.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    bad.fail_updates = True
    slow.update_delay = 1.0

    assert router.client.post("/update_weights_from_distributed", json=bucket(["w"])).status_code == 502
    router.wait_for(lambda: bad.destroys == [{"group_name": "g"}], what="the failed member destroyed the group")
    assert slow.destroys == [], "destroyed while its bucket was still under way"
    router.wait_for(lambda: slow.ended == ["update", "destroy"], what="the other member destroyed it after its bucket")

    # The engines have answered; the router may not have read their answers yet, and says so until it has.
    answers: list[httpx.Response] = []

    def destroyed() -> bool:
        answers.append(router.client.post("/destroy_weights_update_group", json={"group_name": "g"}))
        assert answers[-1].status_code == 200, answers[-1].text
        return "is destroying it" not in answers[-1].json()["message"]

    router.wait_for(destroyed, what="the router's own destroy answered")
    assert sorted(r["url"] for r in answers[-1].json()["engines"]) == sorted([slow.url, bad.url])
    assert len(slow.destroys) == len(bad.destroys) == 1
    assert router.client.post("/destroy_weights_update_group", json={"group_name": "g"}).status_code == 404


def test_a_bucket_waiting_behind_a_failed_one_is_a_conflict(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The failed bucket closes the group while the next one waits for the fleet's lock: the next one is told
    to open the group again (409), not sent to a closed group's members, nor a 500 from closing it twice."""
    good, bad = start_group_engine("good"), start_group_engine("bad")
    router = start_router([good.url, bad.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    bad.fail_updates = True
    good.update_delay = bad.update_delay = 0.5
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(router.client.post, "/update_weights_from_distributed", json=bucket(["w1"]))
        time.sleep(0.2)  # the first holds the lock
        second = pool.submit(router.client.post, "/update_weights_from_distributed", json=bucket(["w2"], version=2))
        answers = first.result(timeout=30), second.result(timeout=30)
    assert answers[0].status_code == 502, answers[0].text
    assert answers[1].status_code == 409 and "was closed while this update waited" in answers[1].text
    assert [u["names"] for u in good.updates] == [["w1"]], "the waiting bucket reached no engine"


def test_a_bucket_whose_member_left_routing_while_it_waited_is_a_conflict_and_reaches_no_engine(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The members are checked again once the bucket has the fleet's lock: one removed while it waited (here
    behind a slow disk load) would have been sent the bucket, out of routing, and recorded on the version."""
    engines = [start_group_engine(name) for name in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    for engine in engines:
        engine.engine.update_delay = 1.0  # the disk load holds the lock
    with ThreadPoolExecutor(2) as pool:
        disk = pool.submit(
            router.client.post, "/update_weights_from_disk", json={"model_path": "/w/1", "weight_version": "1"}
        )
        time.sleep(0.2)
        waiting = pool.submit(router.client.post, "/update_weights_from_distributed", json=bucket(["w"], version=2))
        time.sleep(0.2)  # the bucket waits for the lock
        assert router.client.delete(f"/workers/{engines[1].url}").status_code == 200
        assert disk.result(timeout=30).status_code == 200
        answer = waiting.result(timeout=30)
    assert answer.status_code == 409 and "out of routing" in answer.text, answer.text
    assert all(e.updates == [] for e in engines), "the bucket reached an engine"
    assert router.client.get("/weights_update_groups/g").status_code == 404
    assert router.client.get("/weight_version").json()["weight_version"] == "1"


def test_an_engine_rejoins_only_on_the_registered_disk_copy(
    start_group_engine: Callable[[str], GroupEngine],
    start_engine: Callable[..., FakeEngine],
    start_router: Callable[..., RunningRouter],
) -> None:
    member = start_group_engine("member")
    router = start_router([member.url])
    router.wait_healthy(1)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 2}).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="3")).status_code == 200

    late = start_engine("late")
    assert router.client.post("/workers", json={"url": late.url}).status_code == 202
    router.wait_for(lambda: any("disk copy" in str(w["last_error"]) for w in router.workers()), what="refusal")
    assert late.update_bodies == [] and late.events == []
    group = router.client.get("/weights_update_groups/g").json()
    assert group["current"] is True, "the newcomer is not in routing, so the group still spans the fleet"

    stale = router.client.post("/weight_version/disk_copy", json={"weight_version": "2", "model_path": "/w/v2"})
    assert stale.status_code == 409
    copy = {"weight_version": 3, "model_path": "/w/v3"}
    assert router.client.post("/weight_version/disk_copy", json=copy).status_code == 200
    router.wait_healthy(2)
    assert late.update_bodies == [{"model_path": "/w/v3", "weight_version": "3"}] and late.weight_version == "3"
    assert router.client.get("/weights_update_groups/g").json()["current"] is False, "reopen to include it"


def test_a_restarted_member_waiting_for_the_disk_copy_is_not_restarted_again(
    start_group_engine: Callable[..., GroupEngine],
    start_router: Callable[..., RunningRouter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Back and answering its probes, it waits out of routing for the version's disk copy: the healer used to take
    that for a restart that did not work, and kill and relaunch it after every restart timeout."""
    members = [start_group_engine(name) for name in "ab"]
    restarted: list[GroupEngine] = []
    restarter = RelaunchingRestarter(lambda url: restarted.append(start_group_engine("b", port=port_of(url))))
    router = start_router(
        [m.url for m in members],
        restart_timeout_secs=0.5,
        restart_initial_backoff_secs=0.1,
        health_success_threshold=1,
        **restarter_settings(monkeypatch, restarter),
    )
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="7")).status_code == 200

    assert members[1].engine.server is not None
    members[1].engine.server.stop()
    router.wait_for(lambda: "disk copy" in str(router.workers()[1]["last_error"]), what="the restarted one refused")
    time.sleep(2.0)  # four restart timeouts
    assert restarter.restarts == [members[1].url]
    assert router.workers()[1]["state"] == "unhealthy" and router.workers()[1]["restarting"] is False

    copy = {"weight_version": "7", "model_path": "/w/v7"}
    assert router.client.post("/weight_version/disk_copy", json=copy).status_code == 200
    router.wait_healthy(2)
    assert restarted[0].engine.update_bodies == [{"model_path": "/w/v7", "weight_version": "7"}]


@pytest.mark.parametrize("how", ["deadline", "caller_left"])
def test_a_bucket_that_cannot_get_its_turn_is_never_sent_and_closes_the_group(
    how: str,
    start_group_engine: Callable[[str], GroupEngine],
    start_router: Callable[..., RunningRouter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bucket waits for the fleet's weight lock (here behind a slow disk load) at most the queue deadline, and
    not once its caller left: sent later, it would reach engines after the trainer's broadcast gave up."""
    if how == "deadline":
        monkeypatch.setattr(distributed_weights, "FANOUT_QUEUE_DEADLINE_SECS", 0.3)
    engines = [start_group_engine(name) for name in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    for engine in engines:
        engine.engine.update_delay = 1.5  # the disk load holds the lock

    with ThreadPoolExecutor(1) as pool:
        disk = pool.submit(
            router.client.post, "/update_weights_from_disk", json={"model_path": "/w/1", "weight_version": "1"}
        )
        time.sleep(0.2)
        if how == "deadline":
            refused = router.client.post("/update_weights_from_distributed", json=bucket(["w"], version=2))
            assert refused.status_code == 503, refused.text
            message = refused.json()["error"]["message"]
            assert "waited 0.3s" in message and "not applied" in message and "init_weights_update_group" in message
        else:
            with pytest.raises(httpx.TimeoutException):
                router.client.post("/update_weights_from_distributed", json=bucket(["w"], version=2), timeout=0.3)
        assert disk.result(timeout=30).status_code == 200
    time.sleep(0.5)  # a queued bucket would have been sent by now

    assert all(e.updates == [] for e in engines), "the bucket reached engines after it was given up"
    assert router.client.get("/weights_update_groups/g").status_code == 404
    router.wait_for(lambda: all(e.destroys == [{"group_name": "g"}] for e in engines), what="the group destroyed")
    assert router.client.get("/weight_version").json()["weight_version"] == "1"
    assert [w["healthy"] for w in router.workers()] == [True, True], "no member received part of a version"


@pytest.mark.parametrize("who", ["trainer", "pause_bound"])
def test_generation_never_continues_on_engines_holding_part_of_a_version(
    who: str, start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The trainer died after some buckets of a version: the next trainer's /continue_generation, or the router's
    own once the pause outlived its bound, first takes the members holding those buckets out of routing."""
    engines = [start_group_engine(name) for name in "ab"]
    router = start_router([e.url for e in engines], weight_update_timeout_secs=1.0)  # the pause bound
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 200
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w1"])).status_code == 200

    if who == "trainer":
        assert router.client.post("/continue_generation", json={}).status_code == 200
    else:
        router.wait_for(lambda: all(e.engine.controls[-1][0] == "/continue_generation" for e in engines), timeout=5)
    assert [w["healthy"] for w in router.workers()] == [False, False]
    assert all("part of a weight version" in str(w["last_error"]) for w in router.workers())
    loaded = router.client.post("/update_weights_from_disk", json={"model_path": "/w/2", "weight_version": "2"})
    assert loaded.status_code == 200, loaded.text
    assert [w["healthy"] for w in router.workers()] == [True, True]


def test_members_between_two_buckets_report_part_of_a_version_and_stay_in_routing(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The router knows its members hold part of the version on its way: their report of it is no drift."""
    engines = [start_group_engine(name) for name in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    loaded = router.client.post("/update_weights_from_disk", json={"model_path": "/w/1", "weight_version": "1"})
    assert loaded.status_code == 200, loaded.text  # a fleet version: the health rounds compare what engines report
    assert router.client.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w1"])).status_code == 200
    assert all(e.engine.weights_partial for e in engines)
    time.sleep(0.6)  # six health rounds
    assert [w["healthy"] for w in router.workers()] == [True, True]
    assert [len(e.engine.update_bodies) for e in engines] == [1, 1], "taken out and loaded again mid-version"
    drifts = metric_value(router.client.get("/metrics").text, "rlfleet_router_engine_version_drifts_total")
    assert not drifts, drifts
    last = router.client.post("/update_weights_from_distributed", json=bucket(["w2"], version="2"))
    assert last.status_code == 200, last.text
    assert {w["weight_version"] for w in router.workers()} == {"2"}
    assert [w["healthy"] for w in router.workers()] == [True, True]


def test_a_restarted_router_keeps_engines_reporting_part_of_a_version_out_until_a_whole_load(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A router that restarted mid-version lost its record of which engines took some of its buckets, and knows no
    version to load into them: the engines' own report keeps them out of routing, stranded, and the next fleet
    update (the trainer's disk fallback) loads them too and brings them back."""
    partial, whole = start_engine("partial", weights_partial=True), start_engine("whole")
    router = start_router([partial.url, whole.url])
    router.wait_healthy(1)
    router.wait_for(lambda: "part of a weight version" in str(router.workers()[0]["last_error"]), what="held back")
    time.sleep(0.5)  # more rounds do not let it in
    assert [w["healthy"] for w in router.workers()] == [False, True]
    assert partial.update_bodies == [] and partial.events == []

    loaded = router.client.post("/update_weights_from_disk", json={"model_path": "/w/v2", "weight_version": "2"})
    assert loaded.status_code == 200, loaded.text
    assert sorted(r["url"] for r in loaded.json()["engines"]) == sorted([partial.url, whole.url])
    assert [w["healthy"] for w in router.workers()] == [True, True]
    assert partial.weights_partial is False and {w["weight_version"] for w in router.workers()} == {"2"}


def test_an_engine_in_routing_that_reports_part_of_a_version_leaves_and_loads_the_fleets_whole(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Buckets that reached an engine behind the router's back (another router, a trainer talking to it directly)
    leave its label as it was: the report is what tells the router, which reloads the fleet's version into it."""
    engines = [start_engine(name) for name in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    loaded = router.client.post("/update_weights_from_disk", json={"model_path": "/w/v1", "weight_version": "1"})
    assert loaded.status_code == 200, loaded.text
    engines[0].weights_partial = True
    router.wait_for(lambda: len(engines[0].update_bodies) == 2, what="the fleet's version loaded again")
    router.wait_healthy(2)
    assert engines[0].weights_partial is False and len(engines[1].update_bodies) == 1
    exposition = router.client.get("/metrics").text
    assert metric_value(exposition, "rlfleet_router_engine_version_drifts_total", {"engine": engines[0].url}) == 1


def test_buckets_reach_engines_with_weight_update_sessions_inside_one_per_version(
    start_group_engine: Callable[..., GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang 0.5.23 refuses a bucket outside a session (400): every bucket failed, and every version came from
    disk. The router opens each member's session before a version's first bucket and ends it after the last; an
    engine without sessions (the other fake: 404) takes the buckets as before."""
    new, old = start_group_engine("new", sessions=True), start_group_engine("old")
    router = start_router([new.url, old.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    for version in ("1", "2"):
        for part in (bucket(["w1"]), bucket(["w2"], version=version)):
            answer = router.client.post("/update_weights_from_distributed", json=part)
            assert answer.status_code == 200, answer.text
    assert new.ended == ["begin", "update", "update", "end"] * 2 and not new.session_open
    assert old.ended == ["update"] * 4
    assert {w["weight_version"] for w in router.workers()} == {"2"}


def test_a_session_a_broken_group_left_open_is_ended_before_the_next_version(
    start_group_engine: Callable[..., GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A member fails a bucket: the group closes and its session is ended with it; a session left open anyway (a
    router restarted mid-version) is ended before the next begins, which SGLang refuses while one is open."""
    good, bad = start_group_engine("good", sessions=True), start_group_engine("bad", sessions=True)
    router = start_router([good.url, bad.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    bad.fail_updates = True
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="2")).status_code == 502
    router.wait_for(lambda: "destroy" in good.ended and "destroy" in bad.ended, what="the group destroyed")
    assert not good.session_open and not bad.session_open
    assert good.ended[-2:] == ["end", "destroy"] and bad.ended[-2:] == ["end", "destroy"]

    good.session_open = True  # left open behind the router's back
    bad.fail_updates = False
    fallback = router.client.post("/update_weights_from_disk", json={"model_path": "/w/v2", "weight_version": "2"})
    assert fallback.status_code == 200, fallback.text
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    good.ended.clear()
    answer = router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="3"))
    assert answer.status_code == 200, answer.text
    assert good.ended == ["end", "begin", "update", "end"]


def test_an_engine_with_tensor_parallelism_takes_as_many_ranks_as_its_tp_size(
    start_group_engine: Callable[..., GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang joins each tensor-parallel worker as rank rank_offset + tp_rank: with one rank per engine, a TP-2
    engine's second worker took the next engine's rank and the world was too small, so no group ever formed."""
    wide, narrow = start_group_engine("wide"), start_group_engine("narrow")
    wide.engine.tp_size = 2
    router = start_router([wide.url, narrow.url])
    router.wait_healthy(2)
    world = router.client.get("/weights_update_world_size").json()
    assert world["world_size"] == 4
    offsets = {e["url"]: (e["rank_offset"], e["ranks"]) for e in world["engines"]}
    assert sorted(offsets.values()) in ([(1, 2), (3, 1)], [(1, 1), (2, 2)])

    short = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3})
    assert short.status_code == 409 and "make 4" in short.json()["error"]["message"], short.text
    assert not wide.inits and not narrow.inits
    opened = router.client.post("/init_weights_update_group", json={**INIT, "world_size": 4})
    assert opened.status_code == 200, opened.text
    assert {e.url: (e.inits[0]["rank_offset"], e.inits[0]["world_size"]) for e in (wide, narrow)} == {
        url: (offset, 4) for url, (offset, _) in offsets.items()
    }


def test_an_engine_that_gained_sessions_since_the_last_group_gets_them_in_the_next(
    start_group_engine: Callable[..., GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """An engine restarted on a newer SGLang under its address: the router had found it without sessions (404),
    and a group opened since must ask again, or every bucket is refused outside a session."""
    engine = start_group_engine("upgraded")
    router = start_router([engine.url])
    router.wait_healthy(1)
    for version, sessions in (("1", False), ("2", True)):
        engine.sessions = sessions
        assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 2}).status_code == 200
        answer = router.client.post("/update_weights_from_distributed", json=bucket(["w"], version=version))
        assert answer.status_code == 200, answer.text
    assert engine.ended[-3:] == ["begin", "update", "end"]


def test_ranks_are_read_from_server_info_or_where_its_sglang_has_it(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang deprecated /get_server_info for /server_info (a warning logged at every call, the old name to be
    removed): asked only the old name, an engine that answers the new one alone (404 there) stopped every group from
    forming. /server_info is asked first, and an engine without it (an older SGLang, rlfleet-engine) keeps its own."""
    current = start_engine("current", server_info_routes=("/server_info", "/get_server_info"), tp_size=2)
    older = start_engine("older")  # /get_server_info only
    later = start_engine("later", server_info_routes=("/server_info",), tp_size=4)
    router = start_router([current.url, older.url, later.url])
    router.wait_healthy(3)
    for _ in range(2):
        world = router.client.get("/weights_update_world_size")
        assert world.status_code == 200, world.text
        assert world.json()["world_size"] == 1 + 2 + 1 + 4
    assert current.server_info_calls == later.server_info_calls == ["/server_info"] * 2
    assert older.server_info_calls == ["/server_info", "/get_server_info", "/get_server_info"], "asked where it answers"


def test_a_session_whose_end_failed_as_the_group_closed_is_ended_before_the_disk_fallback(
    start_group_engine: Callable[..., GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A bucket fails and the group closes, but a member refuses the end of its session: SGLang would hold the
    version of the trainer's disk fallback back until an end, and the member would be reloaded for drift again and
    again. The fallback ends the session first."""
    good, bad = start_group_engine("good", sessions=True), start_group_engine("bad", sessions=True)
    router = start_router([good.url, bad.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    bad.fail_updates = True
    good.engine.refused_controls = {"/end_weight_update"}
    assert router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="2")).status_code == 502
    router.wait_for(lambda: "destroy" in good.ended and "destroy" in bad.ended, what="the group destroyed")
    assert good.session_open, "its end was refused"

    good.engine.refused_controls = set()
    fallback = router.client.post("/update_weights_from_disk", json={"model_path": "/w/v2", "weight_version": "2"})
    assert fallback.status_code == 200, fallback.text
    assert not good.session_open and good.ended[-1] == "end"
    router.wait_healthy(2)
    time.sleep(1.0)  # ten health rounds: a member reporting its old version would be reloaded meanwhile
    router.wait_healthy(2)
    assert good.engine.weight_version == "2"
    assert [b["weight_version"] for b in good.engine.update_bodies] == ["2"]
