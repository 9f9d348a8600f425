"""The self-healing loop: an engine that fails its way out of routing is restarted until it is back.

When the worker registry takes an engine out after `health_failure_threshold` failures (probes or
connections), it is already drained: no new request goes to it, and requests that were in flight
there fail over to other engines through the proxy's retries. The healer then asks the restarter to
bring it back and waits, bounded by `restart_timeout_secs`, for the health checker to admit it again
(which loads the fleet's current weights first: the wait goes on while that load runs, bounded by the
weight update timeout, so a large checkpoint is not cut short by a new restart). An attempt that fails
or times out is retried with exponential backoff for as long as the engine stays in the fleet and out of
routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rlfleet.errors import Unavailable
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import Policy
from rlfleet_router.restarters import Restarter
from rlfleet_router.workers import Worker, WorkerRegistry

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
    ) -> None:
        """`loading(worker)`: whether the router is loading weights into `worker` right now."""
        self.restarter = restarter
        self._workers = workers
        self._policy = policy
        self._metrics = metrics
        self._timeout = timeout_secs
        self._initial_backoff = initial_backoff_secs
        self._max_backoff = max_backoff_secs
        self._loading = loading
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def on_failed(self, worker: Worker) -> None:
        """Called by the registry when `worker` leaves routing after repeated failures."""
        running = self._tasks.get(worker.id)
        if running is None or running.done():
            self._tasks[worker.id] = asyncio.create_task(self._heal(worker), name=f"heal-{worker.id}")

    async def stop(self, timeout_secs: float = 5.0) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_secs)
        self._tasks.clear()
        await self.restarter.close()

    async def _heal(self, worker: Worker) -> None:
        attempt = 0
        while self._workers.contains(worker) and not worker.healthy:
            attempt += 1
            worker.restarting = True
            worker.restarts += 1
            old_url = worker.url
            logger.warning("restarting engine %s (attempt %d): %s", old_url, attempt, worker.last_error)
            try:
                async with asyncio.timeout(self._timeout):
                    url = await self.restarter.restart(old_url)
            except Exception as exc:  # whatever went wrong, the engine is still out: retry after the backoff
                self._metrics.restarts.labels(engine=old_url, result="failure").inc()
                worker.last_error = f"restart failed: {type(exc).__name__}: {exc}"
                expected = isinstance(exc, (Unavailable, TimeoutError, OSError))
                logger.warning("restart of %s failed: %s", old_url, worker.last_error, exc_info=not expected)
            else:
                self._metrics.restarts.labels(engine=old_url, result="success").inc()
                if url != old_url:
                    self._workers.move(worker, url)
                    self._metrics.engine_moved(old_url, worker.url)
                self._policy.forget_caches([worker])  # a restarted engine's prefix cache is empty
                worker.consecutive_successes = 0
                if await self._back_in_routing(worker):
                    worker.restarting = False
                    logger.info("engine %s is back in routing after its restart", worker.url)
                    return
                worker.last_error = f"not healthy within {self._timeout:.0f}s of its restart"
            worker.restarting = False
            await asyncio.sleep(min(self._max_backoff, self._initial_backoff * 2 ** (attempt - 1)))
        worker.restarting = False

    async def _back_in_routing(self, worker: Worker) -> bool:
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline or self._loading(worker):
            if worker.healthy or not self._workers.contains(worker):
                return True
            await asyncio.sleep(0.05)
        return False
