"""Freeing the trainer of runs that are over.

The trainer holds a run, and refuses every other one, until StopRun. The orchestrator decides when a
run is over (its record says CANCELLED, FAILED or SUCCEEDED), so it has to get that StopRun through:

- `stop` repeats StopRun, with backoff, until the trainer has let go of the run: the trainer stops after
  its step in progress (a step or weight load can outlast one call's deadline) and may be unreachable
  for a while. Its answer holds what it did up to the stop, which goes into the run's record: a cancel
  does not wait for the step in progress, so the record would otherwise lag the trainer by that step.
  That write is best effort: the run's outcome is recorded before the stop, and Redis being away then
  only leaves the record a step behind (logged).
- `free` asks the trainer which run it holds and stops that run when the records say it is over or do
  not know it. The run queue calls it at start-up and after it answers the Cancel of a run it does not
  drive, and a run whose StartRun finds the trainer busy calls it, so a stop that never got through (its
  bound passed, or the orchestrator died before sending it) is made up then: the run's record is the
  durable note of the stop owed.

A run the records say is QUEUED or RUNNING is never stopped here: something else drives it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from rlfleet.errors import DeadlineExceeded, NotFound, RlfleetError, Unavailable
from rlfleet.sample_stream import redis_refusal, redis_unavailable
from rlfleet.v1.runs_pb2 import Run
from rlfleet.v1.trainer_pb2 import TrainerStatus
from rlfleet_rollout.run_events import is_terminal, state_name
from rlfleet_rollout.run_fence import FencedOut
from rlfleet_rollout.runs_core import RunsCore
from rlfleet_rollout.trainer_client import TrainerClient

logger = logging.getLogger(__name__)

# Longest pause between two StopRun calls of one run (the pause doubles from the first one up to this).
_MAX_PAUSE_S = 10.0


@dataclass(frozen=True)
class Held:
    """What the trainer held when `free` asked it, and what became of it."""

    run_id: str = ""
    """The run it was busy with; empty when it was idle."""
    record_state: str = ""
    """That run's state in the records (QUEUED, RUNNING, ...); empty when they do not know it."""
    freed: bool = False
    """The run was over (or unknown) and has been stopped."""


@dataclass(frozen=True)
class TrainerRelease:
    client: TrainerClient
    core: RunsCore
    within_s: float
    """Bound on stopping one run: the trainer stops after its step in progress, which the step bound bounds."""
    first_pause_s: float
    """Pause before the second StopRun of a run; it doubles for each later one, up to 10 s."""

    async def stop(self, run_id: str, deadline: float | None = None) -> bool:
        """StopRun until the trainer has let go of `run_id` (or says it does not have it), until `deadline`
        (monotonic; by default `within_s` from now); records the trainer's final progress in the run.

        False, logged, when the trainer has not let go by then: `free` stops the run later.
        """
        log = {"run_id": run_id}
        deadline = time.monotonic() + self.within_s if deadline is None else deadline
        pause = self.first_pause_s
        while True:
            try:
                status = await self.client.stop_run(run_id)
            except NotFound:
                return True  # a trainer that restarted since: nothing holds the run
            except (Unavailable, DeadlineExceeded) as exc:
                last = str(exc)
            except RlfleetError as exc:
                logger.error("StopRun of %s failed: %s", run_id, exc, extra=log)
                return False
            else:
                await self._record_progress(run_id, status)
                return True
            if time.monotonic() + pause > deadline:
                logger.error(
                    "the trainer has not let go of run %s (%s); it is stopped when a run finds the trainer busy",
                    run_id,
                    last,
                    extra=log,
                )
                return False
            logger.warning("StopRun of %s: %s; asking again in %.1fs", run_id, last, pause, extra=log)
            await asyncio.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE_S)

    async def free(self, keep: str = "", deadline: float | None = None) -> Held:
        """Stops the run the trainer is busy with if it is not `keep` and the records say it is over or do
        not know it; Unavailable if the trainer has not let go of it by `deadline`."""
        held = await self.client.held()
        if not held.run_id or held.run_id == keep:
            return Held(run_id=held.run_id)
        try:
            record: Run | None = await self.core.get(held.run_id)
        except NotFound:
            record = None
        record_state = state_name(record.state) if record is not None else ""
        if record is not None and not is_terminal(record.state):
            return Held(run_id=held.run_id, record_state=record_state)
        described = f"run {held.run_id} ({record_state or 'unknown to the run records'})"
        log = {"run_id": keep or held.run_id}
        after = f"; run {keep} starts" if keep else ""
        logger.warning("the trainer is still on %s; stopping it", described, extra=log)
        if not await self.stop(held.run_id, deadline):
            raise Unavailable(f"the trainer did not let go of {described}")
        logger.warning("the trainer was freed from %s%s", described, after, extra=log)
        return Held(run_id=held.run_id, record_state=record_state, freed=True)

    async def _record_progress(self, run_id: str, status: TrainerStatus) -> None:
        try:
            await self.core.update(run_id, trainer_progress(status), after_end=True)
        except NotFound:
            pass  # a run the records do not know (free stops those too)
        except FencedOut as exc:  # its driver's write, refused: the run is not this driver's any more
            logger.warning(
                "run %s: the trainer's final progress (step %d) was not recorded: %s",
                run_id,
                status.step,
                exc,
                extra={"run_id": run_id},
            )
        except redis.RedisError as exc:
            if not redis_unavailable(exc):
                raise
            logger.warning(
                "run %s: the trainer's final progress (step %d) was not recorded: Redis unavailable: %s",
                run_id,
                status.step,
                redis_refusal(exc) or exc,
                extra={"run_id": run_id},
            )


def trainer_progress(status: TrainerStatus) -> Callable[[Run], None]:
    """Copies what the trainer reports having done into a run's progress."""

    def record(run: Run) -> None:
        run.progress.step = status.step
        run.progress.weight_version = status.weight_version
        run.progress.groups_trained = status.groups_trained

    return record
