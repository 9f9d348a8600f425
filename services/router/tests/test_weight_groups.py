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

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse
from router_fakes import FakeEngine, RunningRouter, ThreadedServer, metric_value


@dataclass
class GroupEngine:
    """A fake engine that also answers SGLang's distributed weight endpoints, recording each body."""

    engine: FakeEngine
    inits: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    destroys: list[dict[str, Any]] = field(default_factory=list)
    fail_updates: bool = False
    update_delay: float = 0.0

    @property
    def url(self) -> str:
        return self.engine.url


@pytest.fixture
def start_group_engine() -> Iterator[Callable[[str], GroupEngine]]:
    started: list[ThreadedServer] = []

    def start(name: str) -> GroupEngine:
        fake = GroupEngine(FakeEngine(name=name))
        app = fake.engine.app()

        @app.post("/init_weights_update_group")
        async def init(request: Request) -> JSONResponse:
            fake.inits.append(await request.json())
            return JSONResponse({"success": True, "message": "joined"})

        @app.post("/update_weights_from_distributed")
        async def update(request: Request) -> JSONResponse:
            body = await request.json()
            fake.updates.append(body)
            await asyncio.sleep(fake.update_delay)
            if fake.fail_updates:
                return JSONResponse({"success": False, "message": "broadcast timed out"}, status_code=503)
            if body.get("weight_version") is not None:
                fake.engine.weight_version = str(body["weight_version"])
            return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

        @app.post("/destroy_weights_update_group")
        async def destroy(request: Request) -> JSONResponse:
            fake.destroys.append(await request.json())
            return JSONResponse({"success": True, "message": "destroyed"})

        fake.engine.server = ThreadedServer(app).start()
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


def test_a_failed_bucket_takes_the_engine_out_and_closes_the_group(
    start_group_engine: Callable[[str], GroupEngine], start_router: Callable[..., RunningRouter]
) -> None:
    good, bad = start_group_engine("good"), start_group_engine("bad")
    router = start_router([good.url, bad.url])
    router.wait_healthy(2)
    assert router.client.post("/init_weights_update_group", json={**INIT, "world_size": 3}).status_code == 200
    bad.fail_updates = True
    good.update_delay = 0.5  # still receiving when the other member fails

    answer = router.client.post("/update_weights_from_distributed", json=bucket(["w"], version="2"))
    assert answer.status_code == 502 and answer.json()["success"] is False
    # The router stops waiting at the first failure: nobody is known to hold version 2, so it is not the
    # fleet's; the engine it did not wait for stays in routing for the trainer's disk load of the version.
    assert {w["url"] for w in router.workers() if w["healthy"]} == {good.url}
    assert router.client.get("/weight_version").json()["weight_version"] is None
    again = router.client.post("/update_weights_from_distributed", json=bucket(["w"]))
    assert again.status_code == 404 and "init_weights_update_group" in again.json()["error"]["message"]


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
