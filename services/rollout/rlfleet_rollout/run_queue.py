"""The run queue: one active run at a time, RUNNING runs first (resumed after a restart), then QUEUED
runs in submission order.

The queue is the run records in Redis, so nothing is lost when the orchestrator restarts; the
in-process notifier only wakes the queue early and forwards Cancel to the active run's task. While
Redis is unavailable (unreachable, or refusing writes) the queue waits for it (`until_redis_answers`) rather
than ending: a run that could not even record its start, or was left RUNNING when Redis refused its writes, is
picked again once Redis serves it.

At start-up the queue first frees the trainer of a run that ended without its StopRun getting through
(e.g. the previous orchestrator died between recording CANCELLED and sending it): trainer_release.py.

Several orchestrators may end up on one Redis (one started by mistake, one that hangs while its replacement
starts): each run is driven by the one
that holds its lease (run_lease.py), renewed while it drives the run and released when it stops. The
fleet's trainer holds one run at a time, so while another orchestrator drives a run this one starts none;
it takes a run over once that one's lease runs out (its orchestrator died). The driver reads its run's record
while it drives it, for a Cancel another orchestrator answered. A driver stops driving its run, left RUNNING, when
the lease is lost, and when the task that renews it fails (then nothing would renew it, and once it ran out another
orchestrator would drive the run beside this one). Its writes of the run's record are fenced besides (run_fence.py):
one that finds the lease another's, or the record gone or gone back in time (Redis lost writes), is refused, and the
driver stops there, however late its keeper would notice. The failure of any task the queue starts for a run (the
driver, the lease keeper, the follower of Cancels) is logged once, when it happens.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from functools import partial

from redis.exceptions import RedisError

from rlfleet.errors import NotFound, RlfleetError
from rlfleet.sample_stream import redis_refusal, redis_unavailable
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.concurrency import cancel_and_wait, finish, log_task_failure, on_failure
from rlfleet_rollout.metrics import RUN_QUEUE
from rlfleet_rollout.redis_outage import until_redis_answers
from rlfleet_rollout.run_events import is_terminal
from rlfleet_rollout.run_fence import FencedOut, RecordLost
from rlfleet_rollout.run_lease import RunLease
from rlfleet_rollout.run_loop import RunDeps, execute_run

logger = logging.getLogger(__name__)

# Without notifications (e.g. runs submitted through another process) the queue still looks this often.
_IDLE_RECHECK_S = 5.0
# After the lease of a run another orchestrator drives would run out, when the queue looks again (its holder died:
# the run is taken over then, not at the next idle look).
_TAKEOVER_MARGIN_S = 0.05
# After a run was interrupted by its records' outage, before the queue looks again (no tight loop).
_INTERRUPTED_PAUSE_S = 1.0
# Bound on releasing a run's lease once this orchestrator stops driving it; one not released runs out by itself.
_RELEASE_WITHIN_S = 5.0


class RunQueue:
    def __init__(self, deps: RunDeps, lease: RunLease) -> None:
        self.deps = deps
        self.lease = lease
        self._wake = asyncio.Event()
        self._active_id: str | None = None
        self._active_task: asyncio.Task[None] | None = None
        self._left: dict[str, str] = {}
        """The runs last left to other orchestrators, with theirs (to log each once, not at every look)."""
        self._next_look_s = _IDLE_RECHECK_S
        self._free_owed = False
        """A run not driven here ended here: the trainer is asked at the next look whether it still holds it."""
        deps.core.notifier.add_listener(self._on_change)

    async def serve(self) -> None:
        """Runs queued runs one after another until cancelled (which leaves the active run RUNNING)."""
        await self._free_trainer()
        while True:
            self._wake.clear()
            run = await until_redis_answers(self._next_run, RUN_QUEUE, self.deps.metrics)
            if run is None:
                try:
                    # asyncio.timeout, not wait_for, which on Python 3.11 can lose a cancellation (concurrency.py).
                    async with asyncio.timeout(self._next_look_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            # The driver's writes of the run's record are refused once the run is not its own (run_fence.py).
            deps = replace(self.deps, core=self.deps.core.fenced(self.lease.fence(run.id)))
            task = asyncio.create_task(execute_run(run.id, deps), name=f"run {run.id}")
            keeper = asyncio.create_task(self.lease.keep(run.id, task), name=f"lease of run {run.id}")
            # Reported as they fail, not when (or whether) the run's task ends: a keeper failing as the run's task
            # ended went unseen, and asyncio logged it later as an exception never retrieved.
            on_failure(keeper, partial(log_task_failure, logger, run.id, "its lease keeper"))
            follower = asyncio.create_task(self._stop_if_cancelled(run.id, task), name=f"cancel of run {run.id}")
            on_failure(
                follower,
                partial(log_task_failure, logger, run.id, "its follower of Cancels through other orchestrators"),
            )
            self._active_id, self._active_task = run.id, task
            keeper_ended = False
            try:
                # asyncio.wait does not raise when the run's task is cancelled (by Cancel, or by the keeper when
                # the lease was lost), only when this coroutine is (at shutdown); then the run's task is cancelled too.
                # The keeper ends before the run's task only when it failed.
                await asyncio.wait({task, keeper}, return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    keeper_ended = True
                    await self._stop_unleased(run.id, task, keeper)
            except asyncio.CancelledError:
                await cancel_and_wait(task)
                self._report_end(run.id, task)
                raise
            finally:
                self._active_id, self._active_task = None, None
                await self._let_go(run.id, keeper, follower)
            if self._report_end(run.id, task) or keeper_ended:
                await asyncio.sleep(_INTERRUPTED_PAUSE_S)

    def _report_end(self, run_id: str, task: asyncio.Task[None]) -> bool:
        """Logs how the run's task ended, unless it ended the run or was cancelled; True when it did not."""
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return False
        log = {"run_id": run_id}
        if isinstance(exc, FencedOut):
            logger.error(
                "%s. This orchestrator stopped driving the run, and leaves it as its records say", exc, extra=log
            )
            if isinstance(exc, RecordLost):
                # A run whose record is gone has nobody else to stop its trainer (trainer_release.py).
                self._free_owed = True
            return True
        # execute_run records every failure of the run itself; what escapes it is Redis unavailable to the run's
        # records, and the run is picked again from them.
        why = redis_refusal(exc) or f"{type(exc).__name__}: {exc}"
        logger.error("run %s interrupted (%s); it is picked again from its records", run_id, why, extra=log)
        return True

    async def _stop_unleased(self, run_id: str, driving: asyncio.Task[None], keeper: asyncio.Task[None]) -> None:
        """Stops driving a run whose lease keeper ended while it was driven, as a lost lease does: the keeper ends
        then only by a fault of its own (it stops the driving itself when the lease is lost; its failure is logged
        as it happens), after which nothing renews the lease, and once it ran out another orchestrator would drive
        the run beside this one. The run stays RUNNING (unless the driving ends it, e.g. a Cancel now), and is picked
        again from its records once the lease is released, here or by another orchestrator."""
        failed = not keeper.cancelled() and keeper.exception() is not None
        logger.error(
            "run %s: its lease is not renewed any more (%s); this one stops driving it, which stays RUNNING for the "
            "next orchestrator to take its lease",
            run_id,
            "its keeper failed" if failed else "its keeper ended while the run was driven",
            extra={"run_id": run_id},
        )
        await cancel_and_wait(driving)

    async def _stop_if_cancelled(self, run_id: str, driving: asyncio.Task[None]) -> None:
        """Cancels `driving` once the run's record says CANCELLED. A Cancel answered here reaches the run at once
        (`_on_change`); one another orchestrator answered only through the record, which the run loop may not write
        for a whole step: it generated on for a cancelled run while the other freed the trainer for the next."""
        while True:
            await asyncio.sleep(self.deps.config.poll_interval_s)
            try:
                run = await self.deps.core.store.get(run_id)
            except RedisError:
                continue  # looked at again; the run loop meets the outage too
            except NotFound:
                return
            if run.state == RunState.RUN_STATE_CANCELLED:
                if not driving.cancelling():  # not cancelled here already (its StopRun must not be cut short)
                    logger.info("run %s was cancelled through another orchestrator", run_id, extra={"run_id": run_id})
                    driving.cancel()
                return
            if is_terminal(run.state):
                return

    async def _free_trainer(self) -> None:
        try:
            await self.deps.release.free()
        except Exception as exc:
            if not (isinstance(exc, RlfleetError) or redis_unavailable(exc)):
                raise
            # The trainer or Redis unavailable: a run that finds the trainer busy frees it then.
            logger.warning("could not check which run the trainer holds: %s", exc)

    async def _let_go(self, run_id: str, keeper: asyncio.Task[None], follower: asyncio.Task[None]) -> None:
        """Stops following the run's record and renewing its lease, and releases it, so that the next orchestrator
        takes the run at once (after a shutdown) rather than after the lease's time; carried through a shutdown's
        cancellations (bounded)."""

        async def stop_and_release() -> None:
            await cancel_and_wait(follower)
            await cancel_and_wait(keeper)
            await self.lease.release(run_id)

        try:
            await finish(stop_and_release(), within_s=_RELEASE_WITHIN_S)
        except Exception as exc:
            if not (isinstance(exc, TimeoutError) or redis_unavailable(exc)):
                raise
            logger.warning("run %s: its lease was not released (%r); it runs out by itself", run_id, exc)
        finally:
            # The watchers of a run that ended wait for its driver to let go of it (run_events.py).
            self.deps.core.notifier.wake(run_id)

    async def _next_run(self) -> Run | None:
        """The run to drive now, its lease taken: a RUNNING one (to resume) first, else the oldest QUEUED one; None
        when there is none, or while another orchestrator drives one of them."""
        self._next_look_s = _IDLE_RECHECK_S
        runs = await self.deps.core.store.all_in_order([RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_QUEUED])
        if self._free_owed:
            # A run this orchestrator does not drive ended here (a Cancel it answered): its driver stops the trainer
            # if it lives, but one that died (its lease still running) never will, and the trainer would train the
            # cancelled run on until the next run's start.
            self._free_owed = False
            await self._free_trainer()
        running = [r for r in runs if r.state == RunState.RUN_STATE_RUNNING]
        candidates = running or runs[:1]
        if not candidates:
            return None
        run = candidates[0]
        others = await self.lease.others([r.id for r in candidates])
        if not others and await self.lease.hold(run.id):
            self._left = {}
            if run.state == RunState.RUN_STATE_RUNNING:
                logger.info("resuming run %s", run.id, extra={"run_id": run.id})
            return run
        self._leave(others or await self.lease.others([run.id]) or {run.id: "another orchestrator"})
        # None: released since (its holder stopped driving it), so the run is free now.
        expires_in = await self.lease.expires_in_s(run.id) or 0.0
        self._next_look_s = min(_IDLE_RECHECK_S, expires_in + _TAKEOVER_MARGIN_S)
        return None

    def _leave(self, others: dict[str, str]) -> None:
        if others == self._left:
            return
        self._left = others
        for run_id, holder in others.items():
            logger.warning(
                "run %s is driven by another orchestrator (%s): this one leaves it, and starts no run while it goes "
                "on; it takes the run over if that one stops renewing its lease for %.0fs",
                run_id,
                holder,
                self.lease.ttl_s,
                extra={"run_id": run_id},
            )

    def _on_change(self, run: Run) -> None:
        if is_terminal(run.state) and run.id != self._active_id:
            self._free_owed = True
            self._wake.set()
        if run.state == RunState.RUN_STATE_QUEUED:
            self._wake.set()
        elif run.state == RunState.RUN_STATE_CANCELLED and run.id == self._active_id and self._active_task:
            self._active_task.cancel()
