"""The self-healing loop: an engine out of routing that keeps failing its probes is restarted until it is back.

The worker registry hands an engine to the healer (`on_failed`) once it is out of routing, however it got
there (failed probes or connections, a failed weight load, a broken weight update group, version drift, or
never up since it joined), and has failed `health_failure_threshold` probes in a row; a new engine is given
the restart timeout to come up first, as a restarted one is. It is already drained: no new request goes to
it, and requests that were in flight there failed over to other engines through the proxy's retries. The
healer asks the restarter to bring it back and waits, bounded by `restart_timeout_secs`, for it to pass a
probe: the restart has then succeeded. Whether it enters routing is admission's business (it loads the
fleet's weights first, or waits for a disk copy of them): an engine held back there answers its probes, and
restarting it again would not change that. Admission waits for the restart to end: the process answering
meanwhile may be the one the restarter is replacing. An attempt that fails or times out is retried with
exponential backoff for as long as the engine stays in the fleet and passes no probe (one passed during the
backoff is an engine up after all); it reads as restarting all along, backoff included. An engine that fails
again within the restart timeout of coming back is in a crash loop (it passes a probe, then dies loading the
fleet's weights, say): its backoff goes on from where it was, rather than starting over with an immediate
restart each time.

An engine removed from the fleet (`forget`) stops being restarted at once, and nothing more is counted for it.
What the restarter started for it, by a restart or when the router started, is stopped (`Restarter.release`),
whether a restart was under way or not, unless a worker at its URL joined since (added back at once, while a
cancelled restart was still starting the process): the restarter keeps engines by address, so that process is the
new worker's engine, which would otherwise sit without one until its own failures added up to a restart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from rlfleet.errors import Unavailable
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import Policy
from rlfleet_router.restarters import Restarter
from rlfleet_router.workers import Worker, WorkerRegistry, WorkerState, normalize_worker_url

logger = logging.getLogger(__name__)


class Healer:
    def __init__(
        self,
        restarter: Restarter,
        workers: WorkerRegistry,
        policy: Policy,
        metrics: RouterMetrics,
        timeout_secs: float,
        initial_backoff_secs: float,
        max_backoff_secs: float,
        loading: Callable[[Worker], bool] = lambda worker: False,
        remove: Callable[[Worker], object] | None = None,
    ) -> None:
        """`loading(worker)`: whether the router is loading weights into `worker` right now. `remove(worker)` takes
        a worker out of the fleet (by default out of `workers` alone): one whose engine came back at another
        worker's URL, which is that engine already."""
        self.restarter = restarter
        self._workers = workers
        self._policy = policy
        self._metrics = metrics
        self._timeout = timeout_secs
        self._initial_backoff = initial_backoff_secs
        self._max_backoff = max_backoff_secs
        self._loading = loading
        self._remove = remove if remove is not None else self._drop
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Per worker: the attempts of its last restart and when it came back, for a crash loop's backoff to go on.
        self._came_back: dict[str, tuple[int, float]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # restarts cancelled and releases of engines removed, ending

    def on_failed(self, worker: Worker) -> None:
        """Called by the registry when `worker`, out of routing, keeps failing its probes. A new engine gets as long
        to come up as a restarted one (the restart timeout) before it is restarted: it may be loading its model."""
        if worker.state is WorkerState.PENDING and time.monotonic() - worker.added_at < self._timeout:
            return
        if not self._workers.contains(worker):  # removed (a request there lost its connection): nothing to restart
            return
        running = self._tasks.get(worker.id)
        if running is None or running.done():
            self._tasks[worker.id] = asyncio.create_task(self._heal(worker), name=f"heal-{worker.id}")

    def forget(self, worker: Worker) -> None:
        """`worker` left the fleet: its restart stops, and what the restarter started for it is stopped."""
        self._came_back.pop(worker.id, None)
        task = self._tasks.pop(worker.id, None)
        if task is not None and task is asyncio.current_task():
            return  # its own restart removes it: the engine came back as another worker, which keeps what it runs
        if task is not None and not task.done():
            task.cancel()  # the cancelled restart stops what it started
        else:
            task = asyncio.create_task(self._release(worker), name=f"release-{worker.id}")
        self._ending.add(task)  # until it has stopped what it started
        task.add_done_callback(self._ending.discard)

    async def stop(self, timeout_secs: float = 5.0) -> None:
        tasks = [*self._tasks.values(), *self._ending]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_secs)
        self._tasks.clear()
        await self.restarter.close()

    async def _heal(self, worker: Worker) -> None:
        worker.restarting = True
        try:
            await self._restart_until_back(worker)
        except asyncio.CancelledError:
            if not self._workers.contains(worker):  # removed mid-restart: the engine the restarter started goes too
                await self._release(worker)
            raise
        finally:
            worker.restarting = False

    async def _restart_until_back(self, worker: Worker) -> None:
        attempt = 0
        attempts, back_at = self._came_back.pop(worker.id, (0, -math.inf))
        if time.monotonic() - back_at < self._timeout:  # a crash loop: the backoff goes on growing
            attempt = attempts
            logger.warning("engine %s failed again %.0fs after its restart", worker.url, time.monotonic() - back_at)
            await asyncio.sleep(self._backoff(attempt))
        while self._workers.contains(worker) and not worker.healthy:
            attempt += 1
            worker.restarts += 1
            old_url = worker.url
            logger.warning("restarting engine %s (attempt %d): %s", old_url, attempt, worker.last_error)
            try:
                async with asyncio.timeout(self._timeout):
                    url = normalize_worker_url(await self.restarter.restart(old_url))
            except Exception as exc:  # whatever went wrong, the engine is still out: retry after the backoff
                if not self._workers.contains(worker):
                    return
                self._metrics.restarts.inc(old_url, "failure")
                if isinstance(exc, TimeoutError) and not str(exc):  # this bound's, not the restarter's own
                    worker.last_error = f"restart failed: not done within {self._timeout:g}s (--restart-timeout-secs)"
                else:
                    worker.last_error = f"restart failed: {type(exc).__name__}: {exc}"
                expected = isinstance(exc, (Unavailable, TimeoutError, OSError))
                logger.warning("restart of %s failed: %s", old_url, worker.last_error, exc_info=not expected)
            else:
                if not self._workers.contains(worker):
                    return
                if url != old_url:
                    other = self._workers.move(worker, url)
                    if other is not None:
                        logger.warning(
                            "engine %s came back at %s, which is worker %s already: %s leaves the fleet",
                            old_url,
                            url,
                            other.id,
                            worker.id,
                        )
                        self._remove(worker)
                        return
                    self._metrics.engine_moved(old_url, worker.url)
                self._policy.forget_caches([worker])  # a restarted engine's prefix cache is empty
                self._workers.restarted(worker)
                passed = worker.probes_passed
                back = await self._passes_probes(worker, passed)
                if not self._workers.contains(worker):
                    return
                if back:
                    self._came_back[worker.id] = (attempt, time.monotonic())
                    self._metrics.restarts.inc(old_url, "success")
                    logger.info("engine %s passes its probes after its restart", worker.url)
                    return
                self._metrics.restarts.inc(old_url, "failure")
                worker.last_error = f"did not pass a probe within {self._timeout:.0f}s of its restart"
            passed = worker.probes_passed
            await asyncio.sleep(self._backoff(attempt))
            if worker.probes_passed > passed and self._workers.contains(worker):
                # Up after all (a replacement ready just after the restarter gave up): admission's to bring in, and a
                # restart now would kill it, mid-load of the fleet's weights perhaps.
                self._came_back[worker.id] = (attempt, time.monotonic())
                logger.info("engine %s passes its probes after a restart attempt that failed", worker.url)
                return

    def _backoff(self, attempt: int) -> float:
        """The wait after the `attempt`-th restart in a row that did not bring the engine back for good."""
        return min(self._max_backoff, self._initial_backoff * 2 ** (attempt - 1))

    def _drop(self, worker: Worker) -> None:
        self._workers.remove(worker.id)

    async def _release(self, worker: Worker) -> None:
        """Stops what the restarter started for `worker`, removed from the fleet, unless a worker at its URL joined
        since (see the module docstring)."""
        url = worker.url
        if any(other.url == url for other in self._workers.all()):
            logger.info("engine %s was added again while its restart ended: the new worker keeps what it started", url)
            return
        try:
            await self.restarter.release(url)
        except Exception:
            logger.exception("could not stop what the restarter started for %s, removed from the fleet", url)

    async def _passes_probes(self, worker: Worker, passed: int) -> bool:
        """Whether `worker` passes a probe (more than `passed` in all) or is in routing within the restart timeout,
        or for as long as the router loads weights into it."""
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline or self._loading(worker):
            if worker.healthy or worker.probes_passed > passed or not self._workers.contains(worker):
                return True
            await asyncio.sleep(0.05)
        return False
