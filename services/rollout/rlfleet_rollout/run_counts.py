"""The runs-by-state gauge (rlfleet_rollout_runs), counted from the run store by a background task.

Every orchestrator on one Redis shows the store's counts, not its own share of the changes: runs are submitted,
driven and cancelled through any of them (the run lease), so counts moved by one process's changes went negative
on one and stale on the other. The task reads the store's counts (the sizes of its state sets, one round trip)
every REFRESH_EVERY_S, and at once after this process changes a run's state (`changed`). A scrape reads the gauge
only, so a slow Redis does not slow /metrics. A Redis error leaves the last counts, logged once per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_store import RunStore

logger = logging.getLogger(__name__)

REFRESH_EVERY_S = 5.0
"""How stale the counts may get with changes made by other orchestrators (or other writers of the records)."""


class RunCounts:
    def __init__(self, store: RunStore, metrics: RolloutMetrics, every_s: float = REFRESH_EVERY_S) -> None:
        self.store = store
        self.metrics = metrics
        self.every_s = every_s
        self._wake = asyncio.Event()
        self._failing = False

    def changed(self) -> None:
        """A run's state changed here: count again now rather than at the next interval."""
        self._wake.set()

    async def refresh(self) -> bool:
        """Sets the gauge to the store's counts; False (the last counts kept, logged) when Redis failed."""
        try:
            counts = await self.store.count_by_state()
        except Exception as exc:  # noqa: BLE001 - Redis down, or a record that does not decode: the next pass tries again
            if not self._failing:
                logger.warning(
                    "counting runs by state failed; the gauge keeps its last counts: %s: %s", type(exc).__name__, exc
                )
            self._failing = True
            return False
        if self._failing:
            logger.info("counting runs by state works again")
        self._failing = False
        self.metrics.set_run_counts(counts)
        return True

    async def serve(self) -> None:
        """Counts now, then every `every_s` and after each change, until cancelled (with the service)."""
        while True:
            self._wake.clear()  # before counting: a change made meanwhile is counted by the next pass
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.every_s):
                    await self._wake.wait()
