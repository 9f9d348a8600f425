"""One run's conversation with the trainer: start (or resume) it, and wait, bounded, for weight versions.

An unreachable trainer is waited out within the step bound; a trainer that no longer knows the run
(it restarted) is sent StartRun again, which resumes the run from its last checkpoint. A trainer that
refuses the run because it still holds one that is over is freed of it first (trainer_release.py).

A trainer that reports the run STOPPED short of the version awaited trains it no more, and waiting for
the step bound (an hour) would only fail the run then. The run is still this driver's and RUNNING (its
status was just written to the run's fenced record), so the stop is not one the orchestrator owed it: a
trainer shutting down for a restart stops its runs with a checkpoint (its StartRun is then UNAVAILABLE,
waited out as an unreachable trainer is), or a StopRun of an earlier driver, or of an operator, landed
late. It is sent StartRun at once, which resumes the run from its last checkpoint, as after a restart.
Stopped again before it trained a step past that, something keeps stopping it, and the wait ends with a
Conflict naming the versions.

A StartRun in flight is never abandoned: the trainer goes on starting the run after its caller
stops waiting, so a run cancelled meanwhile would leave the trainer busy with it, refusing every
later run. Cancellation waits for StartRun's answer (bounded by its own deadline) before it goes
through, so the StopRun the run loop then sends finds the run started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rlfleet.errors import Conflict, DeadlineExceeded, Internal, NotFound, Unavailable
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus
from rlfleet_rollout.trainer_client import TrainerClient
from rlfleet_rollout.trainer_release import TrainerRelease

logger = logging.getLogger(__name__)

StatusObserver = Callable[[TrainerStatus], Awaitable[None]]

_TRANSIENT = (Unavailable, DeadlineExceeded)


class TrainerSession:
    def __init__(
        self,
        client: TrainerClient,
        run_id: str,
        spec: RunSpec,
        *,
        step_timeout_s: float,
        poll_interval_s: float,
        on_status: StatusObserver,
        release: TrainerRelease,
    ) -> None:
        self.client = client
        self.release = release
        self.run_id = run_id
        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.poll_interval_s = poll_interval_s
        self.on_status = on_status

    async def start(self) -> TrainerStatus:
        """StartRun, retried while the trainer is unreachable or still busy with a run that is over (which it is
        told to stop), within the step bound. A trainer busy with a run that is still live is a Conflict."""
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            last: Exception
            try:
                status = await self._start_once()
                break
            except Conflict as exc:
                try:
                    if await self._free_trainer(exc, deadline):
                        continue
                    last = exc
                except _TRANSIENT as unreachable:
                    last = unreachable
            except _TRANSIENT as exc:
                last = exc
            if time.monotonic() + self.poll_interval_s > deadline:
                raise Unavailable(
                    f"the trainer could not start run {self.run_id} within {self.step_timeout_s:.0f}s: {last}"
                ) from last
            logger.warning("StartRun failed (%s); retrying", last, extra={"run_id": self.run_id})
            await asyncio.sleep(self.poll_interval_s)
        await self._observe(status)
        return status

    async def _free_trainer(self, refused: Conflict, deadline: float) -> bool:
        """After StartRun was refused: True once the trainer has been freed of a run that is over (start at
        once), False while it still starts this very run (for an orchestrator that stopped since: wait);
        raises what makes the refusal final."""
        held = await self.release.free(keep=self.run_id, deadline=deadline)
        if held.freed:
            return True
        if held.run_id == self.run_id:
            return False
        if held.run_id:
            raise Conflict(
                f"the trainer is busy with run {held.run_id}, which is {held.record_state}: something else drives it "
                f"(another orchestrator?), so it is not stopped, and run {self.run_id} cannot start"
            ) from refused
        raise refused  # not a busy trainer (e.g. a checkpoint it cannot resume from): retrying will not help

    async def _start_once(self) -> TrainerStatus:
        """One StartRun, answered before a cancellation of the caller goes through."""
        call = asyncio.ensure_future(self.client.start_run(self.run_id, self.spec))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            log = {"run_id": self.run_id}
            logger.info("run %s cancelled during StartRun; waiting for its answer", self.run_id, extra=log)
            while not call.done():
                try:
                    await asyncio.wait({call})
                except asyncio.CancelledError:
                    pass  # cancelled again (cancel_and_wait repeats itself): the answer still comes first
            if not call.cancelled() and call.exception() is not None:
                logger.warning("StartRun of %s failed: %s", self.run_id, call.exception(), extra=log)
            raise

    async def wait_for_version(self, target: int, can_go_on: Callable[[], Awaitable[None]]) -> TrainerStatus:
        """The trainer's status once it serves weight version `target` or later; DeadlineExceeded after the bound.
        `can_go_on` is awaited on every poll and raises when the run can no longer reach `target`."""
        deadline = time.monotonic() + self.step_timeout_s
        last = "no answer yet"
        resumed_at: int | None = None  # the weight version this wait resumed a stopped run at
        while True:
            try:
                status = await self.client.status(self.run_id)
            except NotFound:
                logger.warning(
                    "the trainer does not know run %s; starting it again", self.run_id, extra={"run_id": self.run_id}
                )
                status = await self.start()
            except _TRANSIENT as exc:
                last = str(exc)
                status = None
            if status is not None:
                await self._observe(status)
                if status.weight_version >= target:
                    return status
                last = f"at weight version {status.weight_version}, step {status.step}"
                if status.state == TrainerState.TRAINER_STATE_STOPPED:
                    resumed_at = await self._resume(status, target, resumed_at)
            await can_go_on()
            if time.monotonic() + self.poll_interval_s > deadline:
                raise DeadlineExceeded(
                    f"the trainer did not reach weight version {target} within {self.step_timeout_s:.0f}s "
                    f"(step timeout; last: {last})"
                )
            await asyncio.sleep(self.poll_interval_s)

    async def _resume(self, stopped: TrainerStatus, target: int, resumed_at: int | None) -> int:
        """StartRun of the run the trainer reports `stopped` short of `target`; the weight version it resumed at.
        Conflict when this wait resumed it before and it has trained no step past that version since."""
        version = stopped.weight_version
        if resumed_at is not None and version <= resumed_at:
            raise Conflict(
                f"the trainer stopped run {self.run_id} again at weight version {version} (step {stopped.step}) "
                f"after it was resumed at version {resumed_at}, while the run waited for version {target}: something "
                "other than this orchestrator stops it (a StopRun of an operator, or of another orchestrator sharing "
                "this trainer); cancel a run through the Runs API"
            )
        logger.warning(
            "the trainer stopped run %s at weight version %d (step %d) before version %d: a stop this run did not ask "
            "for (the trainer shutting down, a late StopRun); resuming it",
            self.run_id,
            version,
            stopped.step,
            target,
            extra={"run_id": self.run_id},
        )
        resumed = await self.start()
        return resumed.weight_version if resumed.state == TrainerState.TRAINER_STATE_TRAINING else version

    async def stop(self) -> None:
        """StopRun until the trainer has let go of the run, bounded; one that does not get through is made up
        when a later run finds the trainer busy (trainer_release.py)."""
        await self.release.stop(self.run_id)

    async def _observe(self, status: TrainerStatus) -> None:
        if status.state == TrainerState.TRAINER_STATE_FAILED:
            raise Internal(f"the trainer failed: {status.error or 'no reason given'}")
        await self.on_status(status)
