"""The health checker: probes every engine on a fixed interval and feeds the worker registry.

One probe per engine at a time: an engine whose previous check is still running (a slow probe,
or a weight load before it rejoins) is skipped in that round rather than probed twice. A probe
that succeeds for an engine out of routing goes through admission (`rlfleet_router.weight_admission`),
which loads the fleet's weights first and brings it in line with the fleet's generation pause.

An engine in routing that the router keeps busy (loading weights it sent, or paused) is checked with
`LIVENESS_ROUTE` instead of the probe, which SGLang makes wait behind the load or the pause
(`rlfleet_router.busy_engines`). An engine out of routing is probed; if the router keeps it busy, a failed
probe counts (towards its restart, too) only if `LIVENESS_ROUTE` fails as well. Once the fleet has a weight
version, an engine in routing that is not loading also has what it reports it serves (weight version and
model path) compared with what the router recorded, in the same round, paused or not: an engine that
restarted by itself faster than the failure window comes back on its initial weights (and not paused), and
must leave routing and load the fleet's version before it serves again. The path tells it apart when the
labels agree (a run whose version "0" is another model than the engines boot with, as "0"); so does a report
of holding part of a version the router is not sending it (`ServedWeights.partial`). That costs one small GET
per engine per interval, off the routing path.

Each round also ends the pauses that outlived their bound (`BusyEngines.expire_pauses`): the router
continues generation on those engines itself (`on_pause_expired`), so a trainer that died between
/pause_generation and /continue_generation cannot stall generation for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

import httpx

from rlfleet.errors import Unavailable
from rlfleet_router.busy_engines import LIVENESS_ROUTE, PAUSED
from rlfleet_router.fleet_pause import FleetPause
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.weight_admission import Admission
from rlfleet_router.weights import FleetWeights, ServedWeights, describe_error
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        client: httpx.AsyncClient,
        workers: WorkerRegistry,
        weights: FleetWeights,
        pauses: FleetPause,
        endpoint: str,
        interval_secs: float,
        timeout_secs: float,
        on_pause_expired: Callable[[list[Worker]], Coroutine[object, object, None]],
        metrics: RouterMetrics | None = None,
    ) -> None:
        """`on_pause_expired(workers)` ends the pause of `workers`, which outlived its bound."""
        self._client = client
        self._workers = workers
        self._weights = weights
        self._pauses = pauses
        self.admission = Admission(weights, workers, pauses)
        self._endpoint = endpoint
        self._interval = interval_secs
        self._timeout = timeout_secs
        self._on_pause_expired = on_pause_expired
        self._metrics = metrics
        self._checks: dict[str, asyncio.Task[None]] = {}
        self._pause_ends: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the periodic loop; its first round runs at once."""
        assert self._loop_task is None, "HealthChecker.start() called twice"
        self._loop_task = asyncio.create_task(self._run(), name="health-loop")

    async def stop(self, timeout_secs: float = 5.0) -> None:
        tasks = [t for t in (self._loop_task, *self._checks.values(), *self._pause_ends) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_secs)
        self._checks.clear()
        self._pause_ends.clear()
        self._loop_task = None

    def check_soon(self, worker: Worker) -> asyncio.Task[None]:
        """Checks `worker` now in the background (unless a check of it is running) and returns that check."""
        running = self._checks.get(worker.id)
        if running is not None and not running.done():
            return running
        task = asyncio.create_task(self.check(worker), name=f"health-check-{worker.id}")
        self._checks[worker.id] = task
        task.add_done_callback(lambda t: self._forget(worker.id, t))
        return task

    async def check(self, worker: Worker) -> None:
        """One probe of `worker` and the state change it implies."""
        busy = self._weights.busy
        changes = busy.changes(worker)
        reason = busy.reason(worker) if worker.healthy else None
        served: ServedWeights | None = None
        if reason is None:
            failure = await self._probe(worker)
        elif reason == PAUSED:  # what it answers is read too: an engine that restarted by itself is paused no more
            failure, served = await self._served(worker, reason)
        else:
            failure = await self._liveness(worker, reason)
        if not self._workers.contains(worker):
            return
        if reason is None and busy.changes(worker) != changes:
            return  # a load or pause of the router began or ended meanwhile: the probe may have waited on it
        held = busy.reason(worker) if failure is not None and reason is None else None
        if held is not None:
            # Out of routing and loading weights the router sent, or paused by it: the probe waited behind that.
            failure = await self._liveness(worker, held)
            if failure is None or not self._workers.contains(worker):
                return
        if failure is not None:
            self._record_failure(worker, failure)
            return
        self._workers.record_success(worker)
        if self._workers.ready_to_admit(worker):
            await self._admit(worker)
        elif (reason is None or served is not None) and worker.healthy and self._weights.target is not None:
            await self._check_version(worker, changes, served)

    async def _check_version(self, worker: Worker, changes: int, served: ServedWeights | None = None) -> None:
        """Takes `worker` out of routing and admits it again (on the fleet's version) if it reports other
        weights than the router recorded (`served`, read here if None): it restarted by itself, or was loaded
        behind the router's back."""
        if served is None:
            try:
                served = await self._weights.served_weights(worker)
            except Unavailable as exc:
                if self._workers.contains(worker) and self._weights.busy.changes(worker) == changes:
                    self._record_failure(worker, str(exc))
                return
        # Part of a version is drift too, unless the router is sending that version to it.
        partial = served.partial and worker.id not in self._weights.receiving
        if (
            not (served.contradicts(worker) or partial)
            or not (self._workers.contains(worker) and worker.healthy)
            or self._weights.busy.changes(worker) != changes  # a load of the router changed its version meanwhile
        ):
            return
        if self._metrics is not None:
            self._metrics.engine_version_drifts.inc(worker.url)
        if partial:
            why = (
                f"reports holding part of a weight version over {served.version!r} (buckets that did not come "
                "through this router)"
            )
        else:
            why = (
                f"serves weight version {served.version!r} from {served.model_path}, not {worker.weight_version!r} "
                f"from {worker.model_path} as recorded (restarted, or loaded behind the router's back)"
            )
        self._workers.take_out(worker, f"{why}; it rejoins on the fleet's version")
        await self._admit(worker)

    async def _admit(self, worker: Worker) -> None:
        try:
            await self.admission.admit(worker)
        except Unavailable as exc:
            if self._workers.contains(worker):
                self._workers.hold_back(worker, str(exc))

    def _record_failure(self, worker: Worker, failure: str) -> None:
        if self._metrics is not None:
            self._metrics.health_check_failures.inc(worker.url)
        self._workers.record_failure(worker, failure)

    async def _served(self, worker: Worker, reason: str) -> tuple[str | None, ServedWeights | None]:
        """`_liveness`, and what `worker` reports it serves (None if it did not answer)."""
        try:
            return None, await self._weights.served_weights(worker)
        except Unavailable as exc:
            cause = exc.__cause__
            return f"{LIVENESS_ROUTE} ({reason}): {describe_error(cause) if cause else exc}", None

    async def _liveness(self, worker: Worker, reason: str) -> str | None:
        """None if `worker`, busy for `reason`, answered LIVENESS_ROUTE within the timeout, else why not."""
        failure, _ = await self._served(worker, reason)
        return failure

    async def _probe(self, worker: Worker) -> str | None:
        """None if the engine answered its health probe with 200 within the timeout, else why not."""
        return await self._answers(worker, self._endpoint, self._endpoint)

    async def _answers(self, worker: Worker, route: str, what: str) -> str | None:
        try:
            response = await self._client.get(f"{worker.url}{route}", timeout=self._timeout)
        except httpx.HTTPError as exc:
            return f"{what}: {describe_error(exc)}"
        if response.status_code != 200:
            return f"{what}: HTTP {response.status_code}"
        return None

    async def _run(self) -> None:
        while True:
            workers = self._workers.all()
            self._pauses.keep_only(workers)
            expired = self._weights.busy.expire_pauses()
            if expired:
                task = asyncio.create_task(self._on_pause_expired(expired), name="end-expired-pauses")
                self._pause_ends.add(task)
                task.add_done_callback(self._pause_ends.discard)
            for worker in workers:
                self.check_soon(worker)
            await asyncio.sleep(self._interval)

    def _forget(self, worker_id: str, task: asyncio.Task[None]) -> None:
        if self._checks.get(worker_id) is task:
            del self._checks[worker_id]
        if not task.cancelled() and task.exception() is not None:
            logger.error("health check of worker %s failed", worker_id, exc_info=task.exception())
