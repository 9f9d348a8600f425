"""The fleet side of the distributed weight path: one weight update group spanning the trainer and the engines.

SGLang's contract is per engine; the router turns it into one fleet-wide group:
  * `init_group`: the healthy engines become the members, engine i of k with rank_offset 1 + i (one
    rank per engine: tensor-parallel engines are not supported here). A world_size other than
    1 + k, or a member that does not answer (`LIVENESS_ROUTE`), is refused before any engine is asked to
    join (an engine that joins blocks until every rank has, so a refusal after that would leave
    the others waiting out their timeout). Every member gets its init at once; each blocks until
    the trainer (rank 0) has joined too, so the trainer calls this while it opens its own end.
  * `update`: one bucket's request goes to every member at once while the trainer broadcasts. The
    request that carries a weight_version makes it the fleet's version, as a disk load does.
    Engines that are healthy but not members (they joined after the group was opened) leave routing
    then, and rejoin on the version's disk copy; the trainer reopens the group to include them.
  * A collective needs every rank, so the router answers as soon as one member fails (instead of
    waiting for the others' timeouts). The members that failed leave routing and the group is
    dropped: a broken collective cannot carry the next bucket. The others may hold part of a
    version; they stay paused (the trainer pauses generation around a version's buckets) until the
    trainer loads the whole version from disk into every healthy engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from rlfleet.errors import Conflict, NotFound, Unavailable
from rlfleet_router.busy_engines import LIVENESS_ROUTE
from rlfleet_router.weights import (
    DISTRIBUTED_UPDATE_ROUTE,
    EngineUpdateResult,
    FleetUpdateResult,
    FleetWeights,
    WeightTarget,
    describe_error,
)
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    worker: Worker
    rank_offset: int


@dataclass(frozen=True)
class WeightGroup:
    name: str
    world_size: int
    backend: str
    members: tuple[Member, ...]

    def describe(self, healthy: list[Worker]) -> dict[str, object]:
        return {
            "group_name": self.name,
            "world_size": self.world_size,
            "backend": self.backend,
            "engines": [{"id": m.worker.id, "url": m.worker.url, "rank_offset": m.rank_offset} for m in self.members],
            # False once an engine left routing or a new one joined: the trainer should open the group again.
            "current": {m.worker.id for m in self.members} == {w.id for w in healthy},
        }


@dataclass(frozen=True)
class GroupResult:
    success: bool
    message: str
    engines: tuple[EngineUpdateResult, ...]

    def describe(self) -> dict[str, object]:
        return {"success": self.success, "message": self.message, "engines": [r.describe() for r in self.engines]}


class DistributedWeights:
    def __init__(
        self, client: httpx.AsyncClient, workers: WorkerRegistry, weights: FleetWeights, probe_timeout_secs: float
    ) -> None:
        self._client = client
        self._probe_timeout = probe_timeout_secs
        self._workers = workers
        self._weights = weights
        self.groups: dict[str, WeightGroup] = {}
        self._version_started: float | None = None  # first bucket of the version on its way

    def group(self, name: str) -> WeightGroup:
        group = self.groups.get(name)
        if group is None:
            raise NotFound(f"no weight update group {name!r}; open one with POST /init_weights_update_group")
        return group

    async def init_group(
        self, master_address: str, master_port: int, world_size: int, name: str, backend: str
    ) -> tuple[GroupResult, WeightGroup]:
        """Opens the group on every healthy engine; returns once each has joined (or failed to)."""
        engines = self._workers.healthy()
        if not engines:
            raise Unavailable("no healthy engine to join a weight update group; GET /workers shows why")
        if world_size != 1 + len(engines):
            raise Conflict(
                f"world_size: {world_size} does not match the fleet: the trainer (rank 0) and {len(engines)} healthy "
                f"engines make {1 + len(engines)}; GET /health counts the healthy engines"
            )
        silent = [problem for problem in await asyncio.gather(*(self._probe(w) for w in engines)) if problem]
        if silent:
            raise Unavailable(
                f"engines of the fleet do not answer, so no group can form: {'; '.join(silent)}; "
                "open the group again once the health checker has taken them out of routing"
            )
        self.groups.pop(name, None)
        group = WeightGroup(name, world_size, backend, tuple(Member(w, 1 + i) for i, w in enumerate(engines)))

        def body(member: Member) -> bytes:
            fields: dict[str, object] = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": member.rank_offset,
                "world_size": world_size,
                "group_name": name,
                "backend": backend,
            }
            return json.dumps(fields).encode()

        # Each member's scheduler waits in the group's rendezvous, and its generation probes with it.
        with self._weights.busy.loading(engines):
            results, _ = await self._post_all(group.members, "/init_weights_update_group", body)
        failed = [r for r in results if not r.success]
        if failed:
            message = f"{len(failed)}/{len(results)} engines could not join weight update group {name!r}"
            return GroupResult(False, message, tuple(results)), group
        self.groups[name] = group
        message = f"{len(results)} engines joined weight update group {name!r} (world_size {world_size})"
        logger.info(message)
        return GroupResult(True, message, tuple(results)), group

    async def update(self, name: str, version: str | None, request_body: bytes) -> FleetUpdateResult:
        """Sends one bucket's request to every member while the trainer broadcasts it."""
        group = self.group(name)
        gone = [m.worker.url for m in group.members if not (self._workers.contains(m.worker) and m.worker.healthy)]
        if gone:
            del self.groups[name]
            raise Conflict(
                f"engines {gone} of weight update group {name!r} are out of routing; "
                "open the group again with POST /init_weights_update_group"
            )
        # Members are busy (their generation probes wait) until what they received is recorded.
        async with self._weights.lock, self._weights.busy.loading_under_lock([m.worker for m in group.members]):
            if self.groups.get(name) is not group:  # closed (a bucket before this one failed) while this waited
                raise Conflict(
                    f"weight update group {name!r} was closed while this update waited for the one before it; "
                    "open the group again with POST /init_weights_update_group"
                )
            if self._version_started is None:
                self._version_started = time.monotonic()
            results, abandoned = await self._post_all(group.members, DISTRIBUTED_UPDATE_ROUTE, lambda _: request_body)
            failed = {r.worker_id: r.message for r in results if not r.success}
            received = {r.worker_id for r in results if r.success}
            self._weights.loaded(
                DISTRIBUTED_UPDATE_ROUTE, request_body, [m.worker for m in group.members if m.worker.id in received]
            )
            for member in group.members:
                if member.worker.id in failed and member.worker.id not in abandoned:
                    reason = f"failed a distributed weight update: {failed[member.worker.id]}"
                    self._workers.take_out(member.worker, reason)
            if version is not None and len(failed) < len(results):
                self._serve_version(group, version, set(failed))
            if failed:
                if self.groups.get(name) is group:  # not already closed by a destroy meanwhile
                    del self.groups[name]
                self._version_started = None
                self._weights.count_update("failure" if len(failed) == len(results) else "partial")
                message = (
                    f"{len(failed)}/{len(results)} engines failed the update through group {name!r}; "
                    "they left routing and the group is closed"
                )
                return FleetUpdateResult(False, message, self._weights.version, tuple(results), ())
            if version is not None:
                self._weights.count_update("success")
        message = f"{len(results)} engines received the update through group {name!r}"
        if version is not None:
            message += f" and serve weight version {version!r}"
        return FleetUpdateResult(True, message, self._weights.version, tuple(results), ())

    def _serve_version(self, group: WeightGroup, version: str, failed: set[str]) -> None:
        """Records `version` as the fleet's (lock held); healthy engines that did not receive it leave routing."""
        self._weights.set_target(WeightTarget(version=version, model_path=None, request_body=None))
        members = {m.worker.id for m in group.members}
        for member in group.members:
            if member.worker.id not in failed:
                member.worker.weight_version = version
        for worker in self._workers.healthy():
            if worker.id not in members:
                self._workers.take_out(worker, f"not in weight update group {group.name!r}, which carried {version!r}")
        assert self._version_started is not None
        self._weights.sync_seconds.labels(path="distributed").observe(time.monotonic() - self._version_started)
        self._version_started = None
        logger.info("weight version %r arrived over group %s", version, group.name)

    async def _probe(self, worker: Worker) -> str | None:
        # Not /health: SGLang's runs a generation, which waits while the trainer has generation paused.
        try:
            response = await self._client.get(f"{worker.url}{LIVENESS_ROUTE}", timeout=self._probe_timeout)
        except httpx.HTTPError as exc:
            return f"{worker.url}: {describe_error(exc)}"
        if response.status_code == 200:
            return None
        return f"{worker.url}: {LIVENESS_ROUTE} answered {response.status_code}"

    async def _post_all(
        self, members: tuple[Member, ...], route: str, body: Callable[[Member], bytes]
    ) -> tuple[list[EngineUpdateResult], set[str]]:
        """POSTs to every member at once and stops waiting at the first failure.

        Returns one result per member, and the ids of the members not waited for.
        """
        tasks = {asyncio.create_task(self._weights.post_update(m.worker, route, body(m))): m for m in members}
        results: dict[str, EngineUpdateResult] = {}
        try:
            for next_done in asyncio.as_completed(tasks):
                result = await next_done
                results[result.worker_id] = result
                if not result.success:
                    break
        finally:
            for task in tasks:
                task.cancel()
        note = "not waited for: another engine of the group failed first"
        abandoned = {m.worker.id for m in members if m.worker.id not in results}
        return [
            results.get(m.worker.id) or EngineUpdateResult(m.worker.id, m.worker.url, False, note, 0.0) for m in members
        ], abandoned

    async def destroy(self, name: str, request_body: bytes) -> GroupResult:
        group = self.group(name)
        del self.groups[name]
        results = await asyncio.gather(
            *(self._weights.post_update(m.worker, "/destroy_weights_update_group", request_body) for m in group.members)
        )
        done = sum(r.success for r in results)
        return GroupResult(done == len(results), f"{done}/{len(results)} engines left group {name!r}", tuple(results))
