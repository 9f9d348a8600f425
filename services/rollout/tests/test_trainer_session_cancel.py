"""A run cancelled while the trainer is still starting it leaves the trainer free for the next run.

The trainer goes on starting a run after its caller stops waiting (its StartRun handler runs in a
thread), and until then it does not know the run, so a StopRun sent at once finds nothing to stop.
The fake trainer here behaves the same way; the session must let StartRun answer before the
cancellation goes through, so the StopRun that follows stops the run."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
from grpc import aio
from trainer_release_support import runs_core, serve_trainer, session

from rlfleet.errors import Conflict
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus

START_S = 0.6


class StartingTrainer(trainer_pb2_grpc.TrainerServicer):
    """Takes START_S to start a run, one run at a time, like TrainerCore."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.starting: str | None = None
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self._lock = threading.Lock()

    def _start(self, run_id: str) -> TrainerStatus:
        with self._lock:
            busy = self.active or self.starting
            if busy is not None and busy != run_id:
                raise Conflict(f"the trainer is busy with run {busy}; stop it before starting {run_id}")
            self.starting = run_id
        time.sleep(START_S)
        with self._lock:
            self.active, self.starting, self.started_at = run_id, None, time.monotonic()
        return TrainerStatus(run_id=run_id, state=TrainerState.TRAINER_STATE_TRAINING)

    async def StartRun(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        try:
            return await asyncio.to_thread(self._start, request.run_id)
        except Conflict as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise

    async def StopRun(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        with self._lock:
            if self.active != request.run_id:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"this trainer has no run {request.run_id!r}")
            self.active, self.stopped_at = None, time.monotonic()
        return TrainerStatus(run_id=request.run_id, state=TrainerState.TRAINER_STATE_STOPPED)


def test_run_cancelled_during_start_run_is_stopped_and_the_trainer_takes_the_next_run(redis_prefix: str) -> None:
    trainer = StartingTrainer()

    async def scenario() -> TrainerStatus:
        async with serve_trainer(trainer) as client, runs_core(redis_prefix) as core:
            first = session(client, core, "run-a")
            starting = asyncio.create_task(first.start())
            await asyncio.sleep(START_S / 4)
            cancelled_at = time.monotonic()
            starting.cancel()  # what Cancel does to the run's task
            done, _ = await asyncio.wait({starting}, timeout=10)
            assert starting in done and starting.cancelled()
            assert trainer.started_at is not None and time.monotonic() >= trainer.started_at > cancelled_at, (
                "the cancellation went through before StartRun answered"
            )
            await first.stop()  # the run loop's answer to a cancelled run
            assert trainer.stopped_at is not None, "StopRun did not find the run it cancelled"
            return await session(client, core, "run-b").start()

    status = asyncio.run(scenario())
    assert status.run_id == "run-b" and trainer.active == "run-b"
