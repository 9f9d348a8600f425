"""One run's conversation with the trainer: start (or resume) it, and wait, bounded, for weight versions.

An unreachable trainer is waited out within the step bound; a trainer that no longer knows the run
(it restarted) is sent StartRun again, which resumes the run from its last checkpoint.

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

from rlfleet.errors import DeadlineExceeded, Internal, NotFound, RlfleetError, Unavailable
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus
from rlfleet_rollout.trainer_client import TrainerClient

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
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.poll_interval_s = poll_interval_s
        self.on_status = on_status

    async def start(self) -> TrainerStatus:
        """StartRun, retried while the trainer is unreachable, within the step bound."""
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            try:
                status = await self._start_once()
                break
            except _TRANSIENT as exc:
                if time.monotonic() + self.poll_interval_s > deadline:
                    raise Unavailable(
                        f"the trainer could not start run {self.run_id} within {self.step_timeout_s:.0f}s: {exc}"
                    ) from exc
                logger.warning("StartRun failed (%s); retrying", exc, extra={"run_id": self.run_id})
                await asyncio.sleep(self.poll_interval_s)
        await self._observe(status)
        return status

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

    async def wait_for_version(self, target: int) -> TrainerStatus:
        """The trainer's status once it serves weight version `target` or later; DeadlineExceeded after the bound."""
        deadline = time.monotonic() + self.step_timeout_s
        last = "no answer yet"
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
            if time.monotonic() + self.poll_interval_s > deadline:
                raise DeadlineExceeded(
                    f"the trainer did not reach weight version {target} within {self.step_timeout_s:.0f}s "
                    f"(step timeout; last: {last})"
                )
            await asyncio.sleep(self.poll_interval_s)

    async def stop(self) -> None:
        """StopRun, best effort: the run's outcome is decided already, so a failure is only logged."""
        try:
            await self.client.stop_run(self.run_id)
        except RlfleetError as exc:
            logger.warning("StopRun of %s failed: %s", self.run_id, exc, extra={"run_id": self.run_id})

    async def _observe(self, status: TrainerStatus) -> None:
        if status.state == TrainerState.TRAINER_STATE_FAILED:
            raise Internal(f"the trainer failed: {status.error or 'no reason given'}")
        await self.on_status(status)
