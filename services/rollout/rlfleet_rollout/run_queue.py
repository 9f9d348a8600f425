"""The run queue: one active run at a time, RUNNING runs first (resumed after a restart), then QUEUED
runs in submission order.

The queue is the run records in Redis, so nothing is lost when the orchestrator restarts; the
in-process notifier only wakes the queue early and forwards Cancel to the active run's task.
"""

from __future__ import annotations

import asyncio
import logging

from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.run_loop import RunDeps, execute_run

logger = logging.getLogger(__name__)

# Without notifications (e.g. runs submitted through another process) the queue still looks this often.
_IDLE_RECHECK_S = 5.0


class RunQueue:
    def __init__(self, deps: RunDeps) -> None:
        self.deps = deps
        self._wake = asyncio.Event()
        self._active_id: str | None = None
        self._active_task: asyncio.Task[None] | None = None
        deps.core.notifier.add_listener(self._on_change)

    async def serve(self) -> None:
        """Runs queued runs one after another until cancelled (which leaves the active run RUNNING)."""
        while True:
            self._wake.clear()
            run = await self._next_run()
            if run is None:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=_IDLE_RECHECK_S)
                except TimeoutError:
                    pass
                continue
            self._active_id = run.id
            self._active_task = asyncio.create_task(execute_run(run.id, self.deps), name=f"run {run.id}")
            try:
                # asyncio.wait does not raise when the run's task is cancelled (by Cancel), only when
                # this coroutine is (at shutdown); then the run's task is cancelled too.
                await asyncio.wait({self._active_task})
            except asyncio.CancelledError:
                await _cancel_and_wait(self._active_task)
                raise
            finally:
                self._active_id, self._active_task = None, None

    async def _next_run(self) -> Run | None:
        runs = await self.deps.core.store.all_in_order([RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_QUEUED])
        running = [r for r in runs if r.state == RunState.RUN_STATE_RUNNING]
        if running:
            logger.info("resuming run %s", running[0].id, extra={"run_id": running[0].id})
            return running[0]
        return runs[0] if runs else None

    def _on_change(self, run: Run) -> None:
        if run.state == RunState.RUN_STATE_QUEUED:
            self._wake.set()
        elif run.state == RunState.RUN_STATE_CANCELLED and run.id == self._active_id and self._active_task:
            self._active_task.cancel()


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
