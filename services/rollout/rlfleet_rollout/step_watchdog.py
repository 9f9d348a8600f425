"""The step watchdog: notices a running run that stopped moving, and says so instead of hanging silently.

Progress is anything the run loop records or counts: the trainer's step and weight version, groups
produced or trained, an evaluation, a sample generated. When none of these changes for
`stall_after_s`, the watchdog

- writes `Run.stalled` ("no progress for 300 s at step 4: ..."), which every watcher of the run
  receives as a run event, and clears it once the run moves again (a note an earlier orchestrator left
  too);
- counts `rlfleet_rollout_step_stalls_total` and keeps `rlfleet_rollout_seconds_without_progress`
  current, so an alert can fire on either;
- logs a warning with the run id and step.

It never ends the run: each wait of the loop has its own bound (`step_timeout_s`, the request
deadlines) that fails the run when it runs out. The watchdog makes the wait visible long before. Nor
does a Redis error end the watchdog: it logs it and looks again, waiting longer each time (up to
`_CHECK_EVERY_S`), until the run's record answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import RedisError

from rlfleet.errors import NotFound, Unavailable
from rlfleet.v1.runs_pb2 import Run
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_fence import FencedOut
from rlfleet_rollout.runs_core import RunEnded

logger = logging.getLogger(__name__)

# How often progress is looked at, at most; a short stall bound is checked four times per bound.
_CHECK_EVERY_S = 5.0

ProgressMark = tuple[int, ...]


class RunRecords(Protocol):
    """What the watchdog needs of `RunsCore`: read a run, and change it as the run loop does."""

    async def get(self, run_id: str) -> Run: ...

    async def update(self, run_id: str, mutate: Callable[[Run], None]) -> Run: ...


def progress_mark(run: Run, samples_generated: float) -> ProgressMark:
    """Everything whose change counts as progress (not `stalled` itself, which the watchdog writes)."""
    p = run.progress
    return (
        p.step,
        p.weight_version,
        p.groups_produced,
        p.groups_trained,
        p.groups_filtered,
        len(run.evals),
        int(samples_generated),
    )


def describe_stall(run: Run, idle_s: float) -> str:
    p = run.progress
    produced_this_step = p.groups_produced >= (p.step + 1) * run.spec.rollout.groups_per_step
    waiting = (
        f"its groups are on the stream; waiting for the trainer (at weight version {p.weight_version})"
        if produced_this_step
        else "producing its groups (generation through the router, scoring at the reward hub)"
    )
    return (
        f"no progress for {idle_s:.0f} s at step {p.step} of {p.total_steps}: {waiting}; "
        f"{p.groups_produced} groups produced, {p.groups_trained} trained"
    )


def samples_generated(metrics: RolloutMetrics) -> float:
    """Samples this orchestrator has produced, every status together."""
    return sum(s.value for family in metrics.samples.collect() for s in family.samples if s.name.endswith("_total"))


async def watch_progress(
    core: RunRecords,
    metrics: RolloutMetrics,
    run_id: str,
    stall_after_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Runs beside the run loop until it is cancelled or the run ends."""
    check_every = min(_CHECK_EVERY_S, stall_after_s / 4)
    pause = check_every
    last_mark: ProgressMark | None = None
    last_moved = clock()
    stalled = False
    log = {"run_id": run_id}
    try:
        while True:
            await asyncio.sleep(pause)
            try:
                run = await core.get(run_id)
                mark = progress_mark(run, samples_generated(metrics))
                now = clock()
                if mark != last_mark:
                    # The record's note, not only this watchdog's: one an earlier orchestrator left (a restart, a
                    # lease taken over) is cleared as the run moves too.
                    if last_mark is not None and run.stalled:
                        await core.update(run_id, _set_stalled(""))
                        logger.info("run %s moves again", run_id, extra=log)
                    stalled = False
                    last_mark, last_moved = mark, now
                    metrics.seconds_without_progress.set(0)
                    pause = check_every
                    continue
                idle = now - last_moved
                metrics.seconds_without_progress.set(idle)
                if idle >= stall_after_s and not stalled:
                    message = describe_stall(run, idle)
                    await core.update(run_id, _set_stalled(message))
                    stalled = True
                    metrics.step_stalls.inc()
                    logger.warning("run %s: %s", run_id, message, extra={**log, "step": run.progress.step})
                pause = check_every
            except (RedisError, Unavailable) as exc:  # the run loop meets it too, and fails the run if it lasts
                pause = min(2 * pause, _CHECK_EVERY_S)
                logger.warning(
                    "the step watchdog of run %s cannot reach the run's record (%s); looking again in %.1fs",
                    run_id,
                    exc,
                    pause,
                    extra=log,
                )
    except (RunEnded, FencedOut, NotFound):
        # The run ended, or is not its driver's any more (NotFound: its record is gone): the run loop meets that too.
        return
    finally:
        metrics.seconds_without_progress.set(0)


def _set_stalled(message: str) -> Callable[[Run], None]:
    def record(run: Run) -> None:
        run.stalled = message

    return record
