"""The fleet side of the distributed weight path: one weight update group spanning the trainer and the engines.

SGLang's contract is per engine; the router turns it into one fleet-wide group:
  * `init_group`: the healthy engines become the members. SGLang joins an engine's tensor-parallel workers
    each as rank rank_offset + its tp_rank, so an engine takes as many ranks as its tp_size (`/server_info`):
    engine i's rank_offset is 1 plus the ranks of the engines before it, and the world is 1 + every engine's
    ranks (`world`, which the trainer asks first). A world_size other than that, or a member that does not
    answer, is refused before any engine is asked to join (an engine that joins blocks until every rank has,
    so a refusal after that would leave the others waiting out their timeout). Every member gets its init at
    once; each blocks until the trainer (rank 0) has joined too, so the trainer calls this while it opens its own
    end.
  * `update`: one bucket's request goes to every member at once while the trainer broadcasts. The
    request that carries a weight_version makes it the fleet's version, as a disk load does; until it
    comes, the members hold part of a version (`FleetWeights.receiving`). Engines that are healthy but
    not members (they joined after the group was opened) leave routing then, and rejoin on the
    version's disk copy; the trainer reopens the group to include them. A member that answers that
    request with `weights_partial: true` (rlfleet-engine: the version's buckets did not deliver every
    parameter, so it kept its old label) did not take the version: it failed the bucket. A bucket waits
    for the fleet's weight lock as a disk load does (FANOUT_QUEUE_DEADLINE_SECS, not once its caller
    left): sent later, it would reach engines after the trainer's side of the broadcast gave up.
  * A collective needs every rank, so the router answers as soon as one member fails (instead of
    waiting for the others' timeouts), and the group is closed: a broken collective cannot carry the
    next bucket. Every member that does not hold the fleet's version whole (it failed, was not waited
    for, or holds only some buckets) leaves routing, stranded (`FleetWeights.strand`): it serves again
    only once it has loaded a whole version, which the trainer's disk fallback of that version does.
    So does generation continuing, or a new group opening, before a version's last bucket.
  * Each member takes a version's buckets inside a weight-update session of its own (SGLang 0.5.23 on), which
    the router opens before the first reaches it and ends once the last is applied, or when the group closes
    (weight_sessions.py; one left open is ended before the engine next loads from disk); the trainer knows nothing
    of it.
  * A group the router closes is destroyed on its engines by the router, each once it is done with its
    last request through it (a destroy behind a pending collective would wait for it, or break it): the
    trainer forgets a group whose broadcast failed, and a later destroy of it from the trainer is
    answered from what the router did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from http import HTTPStatus

import httpx

from rlfleet.errors import Conflict, NotFound, Unavailable
from rlfleet_router.lock_turns import NoTurn, turn
from rlfleet_router.weights import (
    DISTRIBUTED_UPDATE_ROUTE,
    FANOUT_QUEUE_DEADLINE_SECS,
    JSON_HEADERS,
    EngineUpdateResult,
    FleetUpdateResult,
    FleetWeights,
    WeightTarget,
    describe_error,
    parse_json_object,
)
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

DESTROY_ROUTE = "/destroy_weights_update_group"
STOP_SECS = 5.0
"""How long stopping the router waits for the destroys of groups it closed."""


SERVER_INFO_ROUTE = "/server_info"
"""Where an engine says its tp_size. SGLang names it so since it deprecated /get_server_info (logged as deprecated at
every call, to be removed); an engine that answers 404 here (an older SGLang, rlfleet-engine) is asked there
(`LEGACY_SERVER_INFO_ROUTE`)."""
LEGACY_SERVER_INFO_ROUTE = "/get_server_info"


@dataclass(frozen=True)
class Member:
    worker: Worker
    rank_offset: int
    ranks: int = 1  # the engine's tp_size: its workers join as rank_offset .. rank_offset + ranks - 1


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
            "engines": [
                {"id": m.worker.id, "url": m.worker.url, "rank_offset": m.rank_offset, "ranks": m.ranks}
                for m in self.members
            ],
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


def _short_of(result: EngineUpdateResult, version: str) -> EngineUpdateResult:
    """A member's answer to the bucket carrying `version` that says it still holds part of a version: it applied the
    bucket but keeps its old label (rlfleet-engine, when a parameter of the version never came), so for the fleet
    it failed the bucket."""
    return replace(
        result,
        success=False,
        message=f"took the bucket carrying weight version {version!r} but holds part of it (weights_partial: a "
        f"parameter of the version never came), under its previous label: {result.message}",
    )


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
        # Groups the router closed, by name: their destroy on the engines (the latest close of each name).
        self._closed: dict[str, asyncio.Task[GroupResult]] = {}
        self._tasks: set[asyncio.Task[GroupResult]] = set()
        self._sessions = weights.sessions  # the disk loads of FleetWeights end a session a version left open
        self._legacy_server_info: set[str] = set()  # engines (worker ids) that answer only LEGACY_SERVER_INFO_ROUTE

    def group(self, name: str) -> WeightGroup:
        group = self.groups.get(name)
        if group is None:
            raise NotFound(f"no weight update group {name!r}; open one with POST /init_weights_update_group")
        return group

    async def init_group(
        self, master_address: str, master_port: int, world_size: int, name: str, backend: str
    ) -> tuple[GroupResult, WeightGroup]:
        """Opens the group on every healthy engine; returns once each has joined (or failed to)."""
        self._weights.strand_receiving("a weight update group opened before the last bucket of the version on its way")
        self._closed.pop(name, None)  # a destroy of this name now means the group opened here
        members = await self.world()
        expected = 1 + sum(m.ranks for m in members)
        if world_size != expected:
            tensor_parallel = sum(m.ranks > 1 for m in members)
            ranks = f" ({tensor_parallel} of them with tensor parallelism)" if tensor_parallel else ""
            raise Conflict(
                f"world_size: {world_size} does not match the fleet: the trainer (rank 0) and the ranks of "
                f"{len(members)} healthy engines{ranks} make {expected}; GET /weights_update_world_size says it"
            )
        engines = [m.worker for m in members]
        self._sessions.forget(engines)
        self.groups.pop(name, None)
        group = WeightGroup(name, world_size, backend, members)

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
            await self._drop_held(group)
            results, pending = await self._post_all(
                group.members, lambda m: self._weights.post_update(m.worker, "/init_weights_update_group", body(m))
            )
        for task in pending.values():
            task.cancel()
        failed = [r for r in results if not r.success]
        if failed:
            self._close(group)  # the members that joined leave it, or their next init of the name fails
            message = f"{len(failed)}/{len(results)} engines could not join weight update group {name!r}"
            return GroupResult(False, message, tuple(results)), group
        self.groups[name] = group
        message = f"{len(results)} engines joined weight update group {name!r} (world_size {world_size})"
        logger.info(message)
        return GroupResult(True, message, tuple(results)), group

    async def update(
        self,
        name: str,
        version: str | None,
        request_body: bytes,
        caller_gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> FleetUpdateResult:
        """Sends one bucket's request to every member while the trainer broadcasts it; never once its turn at
        the fleet's weight lock did not come within FANOUT_QUEUE_DEADLINE_SECS or before `caller_gone()`."""
        group = self.group(name)
        self._check_members(group)
        what = f"a bucket of weight update group {name!r}"
        try:
            async with turn(self._weights.lock, what, FANOUT_QUEUE_DEADLINE_SECS, caller_gone):
                return await self._send_bucket(group, version, request_body)
        except NoTurn as exc:
            # The trainer's side of this broadcast fails without it: the group cannot carry another bucket.
            if self.groups.get(name) is group:
                self._close(group)
            reopen = "the group is closed: open it again with POST /init_weights_update_group"
            raise Unavailable(f"{exc}; {reopen}") from exc

    async def _send_bucket(self, group: WeightGroup, version: str | None, request_body: bytes) -> FleetUpdateResult:
        """`update` with the fleet's weight lock held."""
        if self.groups.get(group.name) is not group:  # closed (a bucket before this one failed) while this waited
            raise Conflict(
                f"weight update group {group.name!r} was closed while this update waited for the one before it; "
                "open the group again with POST /init_weights_update_group"
            )
        self._check_members(group)  # again: one may have left routing while this waited for the lock
        if not self._weights.receiving:
            self._version_started = time.monotonic()
        members = [m.worker for m in group.members]
        # Members are busy (their generation probes wait) until what they received is recorded.
        with self._weights.busy.loading(members):
            results, pending = await self._post_all(
                group.members, lambda m: self._deliver(m.worker, version, request_body)
            )
        took = {r.worker_id for r in results if r.success}
        self._weights.loaded(DISTRIBUTED_UPDATE_ROUTE, request_body, [w for w in members if w.id in took])
        if version is not None:
            results = [_short_of(r, version) if r.success and r.weights_partial else r for r in results]
        failed = {r.worker_id: r.message for r in results if not r.success and r.worker_id not in pending}
        received = [w for w in members if w.id not in failed and w.id not in pending]
        if version is None:
            self._weights.receiving.update((w.id, w) for w in received)
        elif received:
            self._serve_version(group, version, received)
        if failed:
            return self._broken(group, results, failed, pending, whole=received if version is not None else [])
        if version is not None:
            self._weights.count_update("success")
        message = f"{len(results)} engines received the update through group {group.name!r}"
        if version is not None:
            message += f" and serve weight version {version!r}"
        return FleetUpdateResult(True, message, self._weights.version, tuple(results), ())

    def _check_members(self, group: WeightGroup) -> None:
        """Closes `group` and refuses its bucket (Conflict) when a member is out of routing."""
        gone = [m.worker.url for m in group.members if not (self._workers.contains(m.worker) and m.worker.healthy)]
        if gone:
            self._close(group)
            raise Conflict(
                f"engines {gone} of weight update group {group.name!r} are out of routing; "
                "open the group again with POST /init_weights_update_group"
            )

    def _broken(
        self,
        group: WeightGroup,
        results: list[EngineUpdateResult],
        failed: Mapping[str, str],
        pending: Mapping[str, asyncio.Task[EngineUpdateResult]],
        whole: list[Worker],
    ) -> FleetUpdateResult:
        """A member failed a bucket (lock held): every member but those holding the version `whole` is stranded,
        and the group is closed."""
        held = {w.id for w in whole}
        for member in group.members:
            worker = member.worker
            if worker.id in held:
                continue
            if worker.id in failed:
                reason = f"failed a distributed weight update through group {group.name!r}: {failed[worker.id]}"
            elif worker.id in pending:
                reason = f"not waited for once another member of weight update group {group.name!r} failed"
            else:
                reason = f"received a bucket through weight update group {group.name!r}, which broke before the last"
            self._weights.strand([worker], f"{reason}; it may hold part of a weight version")
        self._close(group, pending)
        self._weights.count_update("partial" if whole else "failure")
        message = (
            f"{len(failed) + len(pending)}/{len(results)} engines failed (or were not waited for) the update through "
            f"group {group.name!r}: the group is closed, and {len(group.members) - len(held)} engines that may hold "
            "part of a weight version left routing until a fleet weight update loads a whole one into them"
        )
        return FleetUpdateResult(False, message, self._weights.version, tuple(results), ())

    def _serve_version(self, group: WeightGroup, version: str, received: list[Worker]) -> None:
        """Records `version` as the fleet's (lock held), held by the members that `received` its last bucket;
        healthy engines that are not members leave routing."""
        target = WeightTarget(version=version, model_path=None, request_body=None)
        self._weights.set_target(target)
        for worker in received:
            self._weights.record_served(worker, target, self._weights.loads)
        members = {m.worker.id for m in group.members}
        for worker in self._workers.healthy():
            if worker.id not in members:
                self._workers.take_out(worker, f"not in weight update group {group.name!r}, which carried {version!r}")
        assert self._version_started is not None
        self._weights.sync_seconds.labels(path="distributed").observe(time.monotonic() - self._version_started)
        self._version_started = None
        logger.info("weight version %r arrived over group %s", version, group.name)

    async def world(self) -> tuple[Member, ...]:
        """The members a group opened now would have (the healthy engines) and their ranks; Unavailable when there
        is none, or one does not answer."""
        engines = self._workers.healthy()
        if not engines:
            raise Unavailable("no healthy engine to join a weight update group; GET /workers shows why")
        answers = await asyncio.gather(*(self._ranks_of(w) for w in engines))
        silent = [answer for answer in answers if isinstance(answer, str)]
        if silent:
            raise Unavailable(
                f"engines of the fleet do not answer, so no group can form: {'; '.join(silent)}; "
                "open the group again once the health checker has taken them out of routing"
            )
        members: list[Member] = []
        offset = 1
        for worker, ranks in zip(engines, answers, strict=True):
            assert isinstance(ranks, int)
            members.append(Member(worker, offset, ranks))
            offset += ranks
        return tuple(members)

    async def _ranks_of(self, worker: Worker) -> int | str:
        """The ranks `worker` takes in a group (its tp_size; 1 when it does not say), or why it did not answer.
        Not /health: SGLang's runs a generation, which waits while the trainer has generation paused."""
        route = LEGACY_SERVER_INFO_ROUTE if worker.id in self._legacy_server_info else SERVER_INFO_ROUTE
        try:
            response = await self._client.get(f"{worker.url}{route}", timeout=self._probe_timeout)
            if response.status_code == HTTPStatus.NOT_FOUND:  # it has the other name only (or has changed since)
                route = SERVER_INFO_ROUTE if route == LEGACY_SERVER_INFO_ROUTE else LEGACY_SERVER_INFO_ROUTE
                response = await self._client.get(f"{worker.url}{route}", timeout=self._probe_timeout)
                if response.status_code != HTTPStatus.NOT_FOUND:
                    self._legacy_server_info.symmetric_difference_update({worker.id})
        except httpx.HTTPError as exc:
            return f"{worker.url}: {describe_error(exc)}"
        if response.status_code != 200:
            return f"{worker.url}: {route} answered {response.status_code}"
        info = parse_json_object(response) or {}
        tp_size = info.get("tp_size", 1)
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            return f"{worker.url}: {route} gave tp_size {tp_size!r}, not a whole number of ranks"
        return tp_size

    async def _deliver(self, worker: Worker, version: str | None, request_body: bytes) -> EngineUpdateResult:
        """One bucket to one member, inside its weight-update session (weight_sessions.py): opened before the
        bucket if it is not, ended once the bucket carrying `version` is applied whole."""
        refused = await self._sessions.begin(worker)
        if refused is not None:
            return refused
        result = await self._weights.post_update(worker, DISTRIBUTED_UPDATE_ROUTE, request_body)
        if version is not None and result.success and not result.weights_partial:
            return await self._sessions.end(worker) or result
        return result

    async def _drop_held(self, group: WeightGroup) -> None:
        """Destroys a group of `group`'s name its members may still hold: SGLang refuses to create a group under a
        name it holds (torch's process groups are registered by name), and one is left behind by a trainer that
        died without destroying it, by this router's restart, or by an init that failed elsewhere. A member
        without it answers that it does not exist, which is what is wanted."""
        body = json.dumps({"group_name": group.name}).encode()

        async def drop(worker: Worker) -> None:
            try:
                response = await self._client.post(
                    f"{worker.url}{DESTROY_ROUTE}", content=body, headers=JSON_HEADERS, timeout=self._probe_timeout
                )
            except httpx.HTTPError as exc:  # the init that follows finds out what is wrong with the engine
                logger.debug("engine %s: %s before joining %r: %s", worker.url, DESTROY_ROUTE, group.name, exc)
                return
            if response.status_code == 200 and (parse_json_object(response) or {}).get("success") is True:
                logger.info("engine %s left weight update group %r it still held", worker.url, group.name)

        await asyncio.gather(*(drop(m.worker) for m in group.members))

    async def _leave(self, worker: Worker, request_body: bytes) -> EngineUpdateResult:
        """Destroys the group on `worker`, its weight-update session ended first (a broken group leaves it open)."""
        await self._sessions.end(worker)
        return await self._weights.post_update(worker, DESTROY_ROUTE, request_body)

    async def _post_all(
        self, members: tuple[Member, ...], call: Callable[[Member], Coroutine[object, object, EngineUpdateResult]]
    ) -> tuple[list[EngineUpdateResult], dict[str, asyncio.Task[EngineUpdateResult]]]:
        """Calls every member at once (a POST, or a bucket's) and stops waiting at the first failure.

        Returns one result per member, and the requests not waited for by member id: still under way, as
        they are at the engines whatever the router does, for the caller to wait for or cancel.
        """
        tasks = {asyncio.create_task(call(m)): m for m in members}
        results: dict[str, EngineUpdateResult] = {}
        try:
            for next_done in asyncio.as_completed(tasks):
                result = await next_done
                results[result.worker_id] = result
                if not result.success:
                    break
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        note = "not waited for: another engine of the group failed first"
        pending = {m.worker.id: task for task, m in tasks.items() if m.worker.id not in results}
        return [
            results.get(m.worker.id) or EngineUpdateResult(m.worker.id, m.worker.url, False, note, 0.0) for m in members
        ], pending

    async def destroy(self, name: str, request_body: bytes) -> GroupResult:
        """Destroys the group on its members; for a group the router closed, says what its own destroy did."""
        group = self.groups.get(name)
        if group is None:
            closed = self._closed.get(name)
            if closed is None:
                raise NotFound(f"no weight update group {name!r}; open one with POST /init_weights_update_group")
            if not closed.done():
                return GroupResult(True, f"the router closed group {name!r} and is destroying it on its engines", ())
            del self._closed[name]
            return closed.result()
        self._forget(group)
        results = await asyncio.gather(*(self._leave(m.worker, request_body) for m in group.members))
        done = sum(r.success for r in results)
        return GroupResult(done == len(results), f"{done}/{len(results)} engines left group {name!r}", tuple(results))

    def _forget(self, group: WeightGroup) -> None:
        """Drops `group`; its members holding part of a version leave routing, since its last bucket cannot come."""
        if self.groups.get(group.name) is group:
            del self.groups[group.name]
        ids = {m.worker.id for m in group.members}
        partial = [w for w in self._weights.receiving.values() if w.id in ids]
        reason = f"weight update group {group.name!r} closed before the last bucket of a weight version"
        self._weights.strand(partial, f"{reason}; it may hold part of it")

    def _close(self, group: WeightGroup, pending: Mapping[str, asyncio.Task[EngineUpdateResult]] | None = None) -> None:
        """Forgets `group` and destroys it on its members in the background, each once its `pending` request
        through the group has ended (it stays busy till then: nothing else loads weights into it meanwhile)."""
        self._forget(group)
        pending = dict(pending or {})
        self._weights.busy.start_loading([m.worker for m in group.members if m.worker.id in pending])
        task = asyncio.create_task(self._destroy_when_done(group, pending), name=f"destroy-group-{group.name}")
        self._closed[group.name] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _destroy_when_done(
        self, group: WeightGroup, pending: dict[str, asyncio.Task[EngineUpdateResult]]
    ) -> GroupResult:
        body = json.dumps({"group_name": group.name}).encode()

        async def destroy_on(member: Member) -> EngineUpdateResult:
            task = pending.get(member.worker.id)
            if task is not None:
                try:
                    await asyncio.wait({task})
                finally:
                    task.cancel()
                    self._weights.busy.end_loading([member.worker])
            return await self._leave(member.worker, body)

        results = await asyncio.gather(*(destroy_on(m) for m in group.members))
        done = sum(r.success for r in results)
        message = f"{done}/{len(results)} engines left group {group.name!r}, which the router closed"
        logger.info(message)
        return GroupResult(done == len(results), message, tuple(results))

    async def stop(self) -> None:
        """Stops the destroys still under way (bounded by STOP_SECS)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_SECS)
