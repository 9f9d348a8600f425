"""Which weights the fleet serves: the fan-out of a weight update, the target, and what each engine holds.

The router records the fleet's target (weight version, model path, and the update request as sent)
once at least one engine has loaded it, as one more fleet load (`loads`: labels repeat, every run
starting at "0", this count does not), and for each engine the load it saw that engine apply
(`Worker.weight_load`). Engines that were not part of that update (pending, taken out, restarted) are
brought to the target by `rlfleet_router.weight_admission` before they enter routing, so rollouts never
mix weights silently. One lock orders fleet updates and the moment an engine enters routing: an engine
either joins on the load current when it joined, or is part of the next fan-out. No slow call to one
engine happens under that lock but a fan-out's own.

An update waits at most FANOUT_QUEUE_DEADLINE_SECS for the one before it, and not at all once its
caller has left: it starts in time or never, so versions never land after the trainer gave up on
them. The engines of a fan-out are busy (`BusyEngines`) until it ends: their generation probes wait
behind the load, so the health checker checks them for liveness only. An engine that did not answer in
time may still finish the load; if no engine confirmed that version, the first one found serving it
makes it the fleet's version (`unconfirmed`, `adopt`), rather than being loaded back to the older one.

A version that arrived over a weight update group (`rlfleet_router.distributed_weights`) has no
disk path at first: the trainer writes a disk copy after the broadcast and registers it
(`register_disk_copy`); until then an engine that rejoins waits out of routing rather than
serving an older version. Engines a group left holding part of a version (`stranded`) also wait out
of routing; the next fleet update (the trainer's disk fallback, sent while generation is paused and
their probes cannot pass) loads them too and brings them back (`rejoin`, in line with the fleet's
generation pause), or leaves them stranded if their load fails. An engine that reports holding part of
a version (`ServedWeights.partial`) the router did not see it take (it restarted since) is stranded too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from http import HTTPStatus

import httpx
from prometheus_client import Histogram

from rlfleet.errors import Conflict, Unavailable
from rlfleet_router.busy_engines import LEGACY_LIVENESS_ROUTE, LIVENESS_ROUTE, LOADING, BusyEngines
from rlfleet_router.lock_turns import turn
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.weight_sessions import WeightSessions
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

JSON_HEADERS = {"content-type": "application/json"}
DISK_UPDATE_ROUTE = "/update_weights_from_disk"
DISTRIBUTED_UPDATE_ROUTE = "/update_weights_from_distributed"
FANOUT_ENGINE_DEADLINE_SECS = 100.0
"""Longest a fleet update waits for one engine, below `weight_update_timeout_secs` when that is
longer: the trainer waits 120 s for one attempt and 300 s in all (`weight_load_timeout_s`), and the
fan-out must answer it before then. An engine slower than this is taken out of routing and loads the
version before it rejoins (admission, which is bounded by `weight_update_timeout_secs` alone)."""
FANOUT_QUEUE_DEADLINE_SECS = 20.0
"""Longest a fleet update waits for the one before it to end; past it, it is refused (503) and never
applied. With FANOUT_ENGINE_DEADLINE_SECS it stays within the 120 s the trainer waits for one attempt."""
ROUTING_CHECK_SECS = 0.2
"""How often a wait looks whether what it waits for still matters: an engine a fan-out waits for taken out
of routing, an engine removed from the fleet while it loads to rejoin."""
# From a small model's disk load to a large model's broadcast.
SYNC_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class WeightTarget:
    version: str
    model_path: str | None  # None: received over a weight update group, disk copy not registered yet
    request_body: bytes | None  # a disk load, sent unchanged to engines that rejoin, so they load what the fleet did


@dataclass(frozen=True)
class ServedWeights:
    """What an engine reports it serves (`LIVENESS_ROUTE`). The path changes with every load from disk (SGLang
    records it), so it tells apart two loads under one label; a version received over a group keeps the path.
    `partial`: it holds buckets of a version whose last it has not applied, under its old label (rlfleet-engine's
    `weights_partial`; SGLang does not say, so it reads as false)."""

    version: str | None
    model_path: str | None
    partial: bool = False

    def contradicts(self, worker: Worker) -> bool:
        """Whether this is not what the router recorded for `worker` (a part either side lacks is not compared)."""
        pairs = ((self.version, worker.weight_version), (self.model_path, worker.model_path))
        return any(seen is not None and recorded is not None and seen != recorded for seen, recorded in pairs)


@dataclass(frozen=True)
class Unconfirmed:
    """A fleet update no engine confirmed while some gave no answer (none in time, or the connection lost): those
    may still finish it."""

    target: WeightTarget
    engines: frozenset[str]  # ids of the engines that did not answer
    adopted_as: int | None = None  # the fleet load it became once one of them was found serving it


@dataclass(frozen=True)
class EngineUpdateResult:
    worker_id: str
    url: str
    success: bool
    message: str
    seconds: float
    answered: bool = True  # False: no answer in time, so the engine may still be loading (SGLang cannot be stopped)
    # It says it holds part of a weight version after this request (rlfleet-engine's `weights_partial`; SGLang
    # does not say): a bucket that carries a version did not complete it there.
    weights_partial: bool = False
    status: int | None = None  # the engine's HTTP status; None without an answer

    def describe(self) -> dict[str, object]:
        return {
            "id": self.worker_id,
            "url": self.url,
            "success": self.success,
            "message": self.message,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class FleetUpdateResult:
    success: bool
    message: str
    weight_version: str | None  # the fleet's version after the update (unchanged if every engine failed)
    engines: tuple[EngineUpdateResult, ...]
    # Not waited for: out of routing when the update began, or taken out by their health checks while
    # it ran (a hung engine). They load the target before they rejoin.
    skipped: tuple[Worker, ...]

    @property
    def http_status(self) -> int:
        """200 when it succeeded; 400 when every engine that answered refused the request itself (4xx: a path it
        cannot read, a body it rejects, as SGLang answers a failed load), which a retry would only send again to
        the whole fleet; else 502 (an engine failing, not answering, or the fleet split)."""
        if self.success:
            return 200
        refused = [r for r in self.engines if r.status is not None and 400 <= r.status < 500]
        return 400 if refused and len(refused) == len(self.engines) else 502

    def describe(self) -> dict[str, object]:
        return {
            "success": self.success,
            "message": self.message,
            "weight_version": self.weight_version,
            "engines": [r.describe() for r in self.engines],
            "skipped": [
                {"id": w.id, "url": w.url, "state": w.state.value, "reason": w.last_error} for w in self.skipped
            ],
        }


def empties_cache(route: str, request_body: bytes) -> bool:
    """Whether an engine that accepted `route` has an empty prefix cache now, as SGLang's has after a weight
    load from disk or over a group, unless the body sets `flush_cache` to false."""
    if route not in (DISK_UPDATE_ROUTE, DISTRIBUTED_UPDATE_ROUTE):
        return False
    try:
        body = json.loads(request_body)
    except ValueError:
        return True
    return not (isinstance(body, dict) and body.get("flush_cache") is False)


class FleetWeights:
    def __init__(
        self,
        client: httpx.AsyncClient,
        workers: WorkerRegistry,
        timeout_secs: float,
        metrics: RouterMetrics,
        on_caches_emptied: Callable[[list[Worker]], None],
        info_timeout_secs: float,
        rejoin: Callable[[list[Worker]], Awaitable[None]],
        on_new_version: Callable[[int], object] | None = None,
    ) -> None:
        """`on_caches_emptied(workers)` runs with the engines a weight load left with an empty prefix cache;
        `info_timeout_secs` bounds reading an engine's weight version (`LIVENESS_ROUTE`, answered from memory);
        `rejoin(workers)` brings stranded engines a fleet update loaded into routing (`Admission.rejoin`), with
        the lock held; `on_new_version(updates)` runs each time the fleet moves to another version, however
        (a load, a group's last bucket, an update no engine confirmed found served), with its count of them."""
        self._client = client
        self._workers = workers
        self._timeout = timeout_secs
        self._info_timeout = info_timeout_secs
        self._legacy_info: set[str] = set()  # engines (worker ids) that answer only LEGACY_LIVENESS_ROUTE
        self._metrics = metrics
        self._on_caches_emptied = on_caches_emptied
        self._rejoin = rejoin
        self._on_new_version = on_new_version
        # Orders fleet updates (disk loads, versioned distributed updates) and admissions into routing.
        self.lock = asyncio.Lock()
        self.target: WeightTarget | None = None
        self.loads = 0  # targets recorded so far: the target is fleet load number `loads`
        self.unconfirmed: Unconfirmed | None = None
        self.updates = 0  # versions the fleet moved to: the age unit of cached trajectories
        # Members of a weight update group that received buckets of a version whose last bucket has not come yet.
        self.receiving: dict[str, Worker] = {}
        # Out of routing because a group broke under them: they may hold part of a version (see `strand`).
        self.stranded: dict[str, Worker] = {}
        # A pause is trusted as long as a weight load may take.
        self.busy = BusyEngines(timeout_secs, metrics.registry, workers)
        self.sessions = WeightSessions(self.post_update)
        self.sync_seconds = Histogram(
            "rlfleet_router_weight_sync_seconds",
            "Time to bring the fleet to a new weight version, by path (disk: one load fan-out; "
            "distributed: from the first bucket of a version to the bucket that carries its version).",
            ["path"],
            buckets=SYNC_BUCKETS,
            registry=metrics.registry,
        )

    @property
    def version(self) -> str | None:
        return self.target.version if self.target else None

    async def update_fleet(
        self,
        model_path: str,
        version: str,
        request_body: bytes,
        caller_gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> FleetUpdateResult:
        """Sends `request_body` to every healthy engine at once; records the target if any engine loaded it.

        Engines that fail leave routing (they may serve either version now) and rejoin through
        admission. So do engines that do not answer within FANOUT_ENGINE_DEADLINE_SECS, and engines
        their health checks take out of routing while the update runs (a hung engine) are no longer
        waited for. If every engine refuses it, nothing changes: they all still serve the old
        version, which is consistent; engines that gave no answer leave routing even then,
        since they may still finish the load (`unconfirmed`). The update starts only if its turn
        comes within FANOUT_QUEUE_DEADLINE_SECS and before `caller_gone()` is true; else it raises
        Unavailable and is never applied. Stranded engines that still answer are sent it too, and rejoin
        routing with it (`rejoin`).
        """
        async with turn(self.lock, f"weight version {version!r}", FANOUT_QUEUE_DEADLINE_SECS, caller_gone):
            started = time.monotonic()
            rejoining = await self._claim_stranded()
            engines = self._workers.healthy() + rejoining
            rejoining_ids = {w.id for w in rejoining}
            skipped = [w for w in self._workers.all() if not w.healthy and w.id not in rejoining_ids]
            if not engines:
                self.count_update("failure")
                raise Unavailable(
                    f"no healthy engine to load weight version {version!r} into; "
                    "GET /workers shows why each engine is out of routing"
                )
            target = WeightTarget(version=version, model_path=model_path, request_body=request_body)
            with self.busy.loading(engines):
                answers = await asyncio.gather(
                    *(self._update_one(w, request_body, w.id in rejoining_ids) for w in engines)
                )
                pairs = zip(engines, answers, strict=True)
                loaded = {w.id for w, answer in pairs if answer is not None and answer.success}
                for worker in rejoining:
                    if worker.id not in loaded and self._workers.contains(worker):
                        self.stranded[worker.id] = worker  # still out of routing, and may hold part of a version
                result = self._record_update(target, engines, answers, skipped, started, rejoining_ids)
            await self._rejoin([w for w in rejoining if w.id in loaded])
            return result

    async def _claim_stranded(self) -> list[Worker]:
        """The stranded engines this fleet update takes along: those that answer `LIVENESS_ROUTE` (the others
        rejoin like any engine out of routing) and have no weight request of the router still pending, which
        could land after this one."""
        for worker in [w for w in self.stranded.values() if not self._workers.contains(w)]:
            del self.stranded[worker.id]
        claimed = [w for w in self.stranded.values() if self.busy.reason(w) != LOADING]
        for worker in claimed:
            del self.stranded[worker.id]
        answers = await asyncio.gather(*(self._answers(w) for w in claimed))
        return [w for w, answered in zip(claimed, answers, strict=True) if answered]

    async def _answers(self, worker: Worker) -> bool:
        try:
            await self.served_weights(worker)
        except Unavailable:
            return False
        return True

    def _record_update(
        self,
        target: WeightTarget,
        engines: list[Worker],
        answers: list[EngineUpdateResult | None],
        skipped: list[Worker],
        started: float,
        rejoining: set[str],
    ) -> FleetUpdateResult:
        """Records what the fan-out to `engines` came to; `rejoining`: the ids of the stranded engines among them,
        out of routing from the start."""
        version = target.version
        # An engine removed from the fleet meanwhile is neither waited for nor counted.
        pairs = [(w, answer) for w, answer in zip(engines, answers, strict=True) if self._workers.contains(w)]
        skipped = [w for w in skipped if self._workers.contains(w)]
        # Engines that may still be loading it: SGLang goes on with a load whose caller left.
        unsure = [w for w, answer in pairs if answer is None or not answer.answered]
        skipped += [w for w, answer in pairs if answer is None]
        answered = [(w, answer) for w, answer in pairs if answer is not None]
        results = [answer for _, answer in answered]
        failed = [r for r in results if not r.success]
        if len(failed) == len(results):
            self.count_update("failure")
            if unsure:
                self.unconfirmed = Unconfirmed(target, frozenset(w.id for w in unsure))
                for worker in unsure:
                    self._workers.take_out(
                        worker,
                        "gave no answer (none in time, or the connection lost) while loading weight version "
                        f"{version!r}; may still load it",
                    )
            if not results:
                raise Unavailable(
                    f"every engine left routing while loading weight version {version!r}; "
                    f"the fleet still serves {shown_version(self.version)}; GET /workers shows why"
                )
            message = (
                f"no engine loaded weight version {version!r}; the fleet still serves {shown_version(self.version)}"
            )
            if unsure:
                message += (
                    f"; {len(unsure)} gave no answer (none in time, or the connection lost) and left routing: "
                    "the first found serving "
                    f"{version!r} makes it the fleet's version"
                )
            return FleetUpdateResult(
                success=False,
                message=message,
                weight_version=self.version,
                engines=tuple(results),
                skipped=tuple(skipped),
            )
        self.set_target(target)
        self.sync_seconds.labels(path="disk").observe(time.monotonic() - started)
        # An engine that loaded it and left routing before the others answered (dead, say) is recorded as holding
        # nothing: its process may be replaced by one on its boot weights, which its admission must load.
        left = [w for w, r in answered if r.success and not w.healthy and w.id not in rejoining]
        skipped += left
        for worker, result in answered:
            if result.success and worker not in left:
                self.record_served(worker, target, self.loads)
            elif not result.success:
                self._workers.take_out(worker, f"failed to load weight version {version!r}: {result.message}")
        self.loaded(DISK_UPDATE_ROUTE, target.request_body or b"", [w for w, r in answered if r.success])
        self.count_update("partial" if failed else "success")
        loaded = len(results) - len(failed) - len(left)
        message = f"{loaded}/{len(results)} engines serve weight version {version!r}"
        if failed:
            message += "; the others were taken out of routing until they load it"
        if len(skipped) > 0:
            message += f"; {len(skipped)} out of routing were not waited for and load it before they rejoin"
        logger.info("weight update: %s", message)
        return FleetUpdateResult(
            success=not failed,
            message=message,
            weight_version=version,
            engines=tuple(results),
            skipped=tuple(skipped),
        )

    async def _update_one(self, worker: Worker, request_body: bytes, rejoining: bool) -> EngineUpdateResult | None:
        """`worker`'s answer to a fleet update, or None once its health checks take it out of routing
        (it hangs, or died) or it is removed from the fleet: the update stops waiting for it, and it loads the
        version before it rejoins. A `rejoining` (stranded) engine is out of routing already: it is waited for
        while it is in the fleet."""
        post = asyncio.create_task(
            self.load_from_disk(worker, request_body, timeout=min(self._timeout, FANOUT_ENGINE_DEADLINE_SECS))
        )
        while True:
            done, _ = await asyncio.wait({post}, timeout=ROUTING_CHECK_SECS)
            if done:
                return post.result()
            if not self._workers.contains(worker) or not (rejoining or worker.healthy):
                post.cancel()
                await asyncio.wait({post})
                if not self._workers.contains(worker):
                    logger.info("worker %s was removed from the fleet while loading weights", worker.url)
                    return None
                reason = worker.last_error
                logger.warning("worker %s left routing while loading weights (%s); not waited for", worker.url, reason)
                self._metrics.weight_update_engines_skipped.inc()
                return None

    async def load_from_disk(
        self, worker: Worker, request_body: bytes, timeout: float | None = None
    ) -> EngineUpdateResult:
        """Loads weights from disk into one engine (`request_body`, SGLang's), its weight-update session ended first
        (`WeightSessions.before_disk_load`), both within `timeout` (`weight_update_timeout_secs` when None)."""
        budget = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        await self.sessions.before_disk_load(worker, budget)
        left = max(deadline - time.monotonic(), 0.0)
        return await self.post_update(worker, DISK_UPDATE_ROUTE, request_body, timeout=left)

    def loaded(self, route: str, request_body: bytes, workers: list[Worker]) -> None:
        """`workers` accepted the weight request `route` with `request_body`: their caches are empty if it flushes."""
        if workers and empties_cache(route, request_body):
            self._on_caches_emptied(workers)

    def count_update(self, result: str) -> None:
        """Counts one fleet-wide update by result: success, partial or failure."""
        self._metrics.weight_updates.labels(result=result).inc()

    def set_target(self, target: WeightTarget) -> None:
        """Records the version the fleet now serves, as a new fleet load (call with `lock` held)."""
        moved = self.target is None or target.version != self.target.version
        if moved:
            self.updates += 1  # a retry of the version the fleet serves is no newer: cached trajectories keep their age
        self.target = target
        self.loads += 1
        self.unconfirmed = None
        if moved and self._on_new_version is not None:
            self._on_new_version(self.updates)

    def adopt(self, unconfirmed: Unconfirmed) -> int:
        """Makes the version of an update no engine confirmed the fleet's (call with `lock` held), an engine it did
        not hear back from having been found serving it; returns its fleet load. Engines in routing serve the
        older version: they leave it and load this one before they rejoin."""
        self.set_target(unconfirmed.target)
        self.unconfirmed = replace(unconfirmed, adopted_as=self.loads)
        for worker in self._workers.healthy():
            self._workers.take_out(
                worker, f"serves weight version {worker.weight_version!r}; the fleet moved to {self.version!r}"
            )
        return self.loads

    def record_served(self, worker: Worker, target: WeightTarget, load: int) -> None:
        """`worker` applied fleet load `load` of `target` whole. A target received over a group (no model path)
        leaves the path the engine reports as it was."""
        worker.weight_version = target.version
        worker.model_path = target.model_path or worker.model_path
        worker.weight_load = load
        self.receiving.pop(worker.id, None)
        self.stranded.pop(worker.id, None)

    def strand(self, workers: Iterable[Worker], reason: str) -> None:
        """`workers` leave routing because a weight update group broke under them: they may hold part of a
        version, so they serve again only once they have loaded a whole one. They are alive and, mid-version,
        paused by the trainer, whose disk fallback of that version is the next fleet update: it loads them
        too (`_claim_stranded`), since admission cannot while their generation probes wait behind the pause."""
        for worker in workers:
            self._workers.take_out(worker, reason)
            self.receiving.pop(worker.id, None)
            self.stranded[worker.id] = worker

    def strand_receiving(self, reason: str) -> None:
        """Engines holding part of a version whose last bucket will not come now (generation continues, the
        group closed) leave routing: see `strand`."""
        self.strand(list(self.receiving.values()), f"{reason}; it may hold part of a weight version")

    def before_continue(self) -> list[Worker]:
        """Generation is about to continue: engines holding part of a version whose last bucket has not come leave
        routing; returns every stranded engine, none of which may resume the requests it holds (`Fanout`)."""
        self.strand_receiving("generation continued before the last bucket of the weight version on its way")
        return list(self.stranded.values())

    def register_disk_copy(self, version: str, model_path: str, request_body: bytes) -> None:
        """Records where engines that rejoin load the current `version` from; refuses any other version."""
        if self.target is None or self.target.version != version:
            raise Conflict(
                f"weight_version: the fleet serves {shown_version(self.version)}, not {version!r}; "
                "a disk copy can only be registered for the current version"
            )
        # The same weights as the load the target stands for: engines that applied it need not load this.
        self.target = WeightTarget(version=version, model_path=model_path, request_body=request_body)
        logger.info("disk copy of weight version %r registered at %s", version, model_path)

    async def served_weights(self, worker: Worker) -> ServedWeights:
        """What `worker` reports it serves (`LIVENESS_ROUTE`, or the legacy route where that is unknown: 404);
        Unavailable if it does not answer."""
        route = LEGACY_LIVENESS_ROUTE if worker.id in self._legacy_info else LIVENESS_ROUTE
        try:
            response = await self._client.get(f"{worker.url}{route}", timeout=self._info_timeout)
            if response.status_code == HTTPStatus.NOT_FOUND:  # an SGLang that has the other route only
                route = LIVENESS_ROUTE if route == LEGACY_LIVENESS_ROUTE else LEGACY_LIVENESS_ROUTE
                response = await self._client.get(f"{worker.url}{route}", timeout=self._info_timeout)
                if response.status_code != HTTPStatus.NOT_FOUND:
                    self._legacy_info.symmetric_difference_update({worker.id})
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise Unavailable(
                f"could not read the weight version of {worker.url}: {route}: {describe_error(exc)}"
            ) from exc
        if not isinstance(info, dict):
            return ServedWeights(None, None)
        version, path = info.get("weight_version"), info.get("model_path")
        return ServedWeights(
            None if version is None else str(version),
            path if isinstance(path, str) else None,
            partial=info.get("weights_partial") is True,
        )

    async def post_update(
        self, worker: Worker, route: str, request_body: bytes, timeout: float | None = None
    ) -> EngineUpdateResult:
        """POSTs a weight request to one engine, within `timeout` (`weight_update_timeout_secs` when
        None); success needs HTTP 200 and `success: true`."""
        start = time.monotonic()
        success = False
        answered = True
        partial = False
        status = None
        try:
            response = await self._client.post(
                f"{worker.url}{route}",
                content=request_body,
                headers=JSON_HEADERS,
                timeout=self._timeout if timeout is None else timeout,
            )
        except httpx.HTTPError as exc:
            message = describe_error(exc)
            # Sent but unanswered (no answer in time, or the connection lost while waiting for one, as a proxy
            # in between may cut it): the engine may be loading still. One it never reached is not.
            answered = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
        else:
            status = response.status_code
            # SGLang answers {success, message}; success needs both HTTP 200 and `success: true`.
            body = parse_json_object(response)
            if body is None:
                message = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                success = response.status_code == 200 and body.get("success") is True
                message = str(body.get("message") or f"HTTP {response.status_code}")
                partial = body.get("weights_partial") is True
        if not success:
            logger.warning("worker %s failed %s: %s", worker.url, route, message)
        seconds = time.monotonic() - start
        return EngineUpdateResult(worker.id, worker.url, success, message, seconds, answered, partial, status)


def shown_version(version: str | None) -> str:
    """A weight version for a message: quoted, or "no version yet" before the fleet's first load."""
    return "no version yet" if version is None else repr(version)


def parse_json_object(response: httpx.Response) -> dict[str, object] | None:
    try:
        body = response.json()
    except ValueError:  # not JSON, not UTF-8, or an integer of over 4300 digits
        return None
    return body if isinstance(body, dict) else None


def describe_error(exc: BaseException) -> str:
    """A connection error as one line (httpx errors often have an empty str())."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
