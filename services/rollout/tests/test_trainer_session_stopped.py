"""A trainer that reports the run STOPPED short of the weight version the run waits for.

It trains the run no more, and the wait went on for the whole step bound (an hour by default) before the run failed.
A stop the run did not ask for (the trainer shutting down for a restart, a late StopRun) is resumed at once with
StartRun, as after a restart; a run stopped again before it trained a step since ends the wait with a Conflict."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc import aio
from trainer_release_support import runs_core, serve_trainer, session

from rlfleet.errors import Conflict
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus

STEP_TIMEOUT_S = 5.0
STOPPED, TRAINING = TrainerState.TRAINER_STATE_STOPPED, TrainerState.TRAINER_STATE_TRAINING


class StoppedTrainer(trainer_pb2_grpc.TrainerServicer):
    """Holds the run STOPPED at weight version 2 until StartRun (UNAVAILABLE the first `closing_starts` times, as a
    trainer shutting down answers), then trains a step per Status; with `stops_again`, something stops the run
    again before its first step."""

    def __init__(self, closing_starts: int = 0, stops_again: bool = False) -> None:
        self.state, self.version = STOPPED, 2
        self.closing_starts = closing_starts
        self.stops_again = stops_again
        self.starts = 0

    def _status(self, run_id: str) -> TrainerStatus:
        return TrainerStatus(run_id=run_id, state=self.state, step=self.version, weight_version=self.version)

    async def Status(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        if self.state == TRAINING:
            if self.stops_again:
                self.state = STOPPED
            else:
                self.version += 1
        return self._status(request.run_id)

    async def StartRun(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        self.starts += 1
        if self.closing_starts > 0:
            self.closing_starts -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the trainer is shutting down; run cannot start here")
        self.state = TRAINING
        return self._status(request.run_id)


async def _can_go_on() -> None:
    return None


def _wait(trainer: StoppedTrainer, redis_prefix: str, target: int) -> tuple[TrainerStatus | BaseException, float]:
    """wait_for_version(target) of run-a against `trainer`: its status or error, and the seconds it took."""

    async def scenario() -> TrainerStatus | BaseException:
        async with serve_trainer(trainer) as client, runs_core(redis_prefix) as core:
            waiting = session(client, core, "run-a", step_timeout_s=STEP_TIMEOUT_S, poll_interval_s=0.05)
            try:
                return await waiting.wait_for_version(target, _can_go_on)
            except Exception as exc:  # noqa: BLE001 - the test looks at which
                return exc

    started = time.monotonic()
    outcome = asyncio.run(scenario())
    return outcome, time.monotonic() - started


def test_a_run_the_trainer_stopped_for_a_restart_is_resumed_at_once(redis_prefix: str) -> None:
    """The trainer shutting down stops its runs with a checkpoint, then answers StartRun UNAVAILABLE until it is
    back: the wait resumes the run, and it reaches the version awaited."""
    trainer = StoppedTrainer(closing_starts=2)
    outcome, took = _wait(trainer, redis_prefix, target=5)
    assert isinstance(outcome, TrainerStatus), outcome
    assert outcome.weight_version == 5 and outcome.state == TRAINING
    assert trainer.starts == 3 and took < STEP_TIMEOUT_S / 2


def test_a_run_stopped_again_after_it_was_resumed_ends_the_wait_with_a_conflict(redis_prefix: str) -> None:
    trainer = StoppedTrainer(stops_again=True)
    outcome, took = _wait(trainer, redis_prefix, target=5)
    assert isinstance(outcome, Conflict), outcome
    assert str(outcome).startswith(
        "the trainer stopped run run-a again at weight version 2 (step 2) after it was resumed at version 2, while "
        "the run waited for version 5"
    )
    assert trainer.starts == 1 and took < STEP_TIMEOUT_S / 2


def test_a_run_stopped_at_the_version_awaited_is_not_resumed(redis_prefix: str) -> None:
    """The last wait of a run finds it STOPPED at its final version: the trainer ends a run there itself."""
    trainer = StoppedTrainer()
    outcome, _ = _wait(trainer, redis_prefix, target=2)
    assert isinstance(outcome, TrainerStatus) and outcome.state == STOPPED, outcome
    assert trainer.starts == 0
