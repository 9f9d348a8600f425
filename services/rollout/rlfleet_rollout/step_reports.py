"""Copies the trainer's step reports into a run's record, losing none across reconnects or at the run's end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis

from rlfleet.errors import RlfleetError
from rlfleet.sample_stream import redis_refusal, redis_unavailable
from rlfleet.v1.runs_pb2 import Run
from rlfleet_rollout.run_fence import FencedOut
from rlfleet_rollout.runs_core import RunEnded, RunsCore
from rlfleet_rollout.trainer_client import TrainerClient

logger = logging.getLogger(__name__)

# Longest pause before following the reports again while the run's record cannot be written (Redis away).
_MAX_PAUSE_S = 30.0


class StepReportFollower:
    """Follows WatchSteps for one run and keeps the latest report's metrics in the run (`Run.metrics`).

    The trainer keeps a run's reports, so a reconnect asks for the steps after the last one copied and
    nothing made in between is missed; `caught_up` lets the run wait, bounded, for its last step's report
    before it records its final state. A report that cannot be written (Redis away) is asked for again
    later, with growing pauses, as after a reconnect.
    """

    def __init__(self, trainer: TrainerClient, core: RunsCore, run_id: str, reconnect_after_s: float) -> None:
        self.trainer = trainer
        self.core = core
        self.run_id = run_id
        self.reconnect_after_s = reconnect_after_s
        self.step = 0
        """The last step whose report is in the run's record."""
        self._copied = asyncio.Condition()

    async def follow(self) -> None:
        """Copies reports until the run ends; run it as a task and cancel it when the run is done."""
        pause = self.reconnect_after_s
        while True:
            try:
                async for report in self.trainer.watch_steps(self.run_id, from_step=self.step + 1):
                    if report.step <= self.step:
                        continue
                    await self.core.update(self.run_id, _metrics_setter(dict(report.metrics)))
                    async with self._copied:
                        self.step = report.step
                        self._copied.notify_all()
                    pause = self.reconnect_after_s
            except RunEnded:
                return
            except FencedOut:
                return  # the run is not this driver's any more: its loop meets that too, and stops
            except RlfleetError as exc:
                logger.debug("WatchSteps of %s ended: %s", self.run_id, exc, extra={"run_id": self.run_id})
            except redis.RedisError as exc:
                if not redis_unavailable(exc):
                    raise
                pause = min(2 * pause, _MAX_PAUSE_S)
                logger.warning(
                    "the trainer's step reports of run %s cannot be recorded after step %d (Redis unavailable: %s); "
                    "following them again in %.1fs",
                    self.run_id,
                    self.step,
                    redis_refusal(exc) or exc,
                    pause,
                    extra={"run_id": self.run_id},
                )
            await asyncio.sleep(pause)

    async def caught_up(self, step: int, timeout_s: float) -> bool:
        """Waits until the report of `step` is in the run's record; False if it is not within `timeout_s`."""
        async with self._copied:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._copied.wait_for(lambda: self.step >= step)
            except TimeoutError:
                return False
        return True


def _metrics_setter(metrics: dict[str, float]) -> Callable[[Run], None]:
    def record(run: Run) -> None:
        run.metrics.clear()
        run.metrics.update(metrics)

    return record
