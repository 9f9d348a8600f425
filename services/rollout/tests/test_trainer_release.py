"""A run that is over leaves the trainer free for the next one, whatever its StopRun met on the way.

The audit's case: a cancel sent one StopRun, which the trainer could not answer in time (a long step or
weight load, or a paused process), so the trainer kept the cancelled run and refused every later one.
Here the session repeats StopRun until the trainer lets go, a run that finds the trainer still on a run
that is over stops it first, and a run that another orchestrator drives is never taken away from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import pytest
from grpc import aio
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core, serve_trainer, session

from rlfleet.errors import Conflict, Internal
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import Run, RunProgress, RunState
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus
from rlfleet_rollout import run_loop
from rlfleet_rollout.runs_core import RunsCore
from rlfleet_rollout.trainer_session import TrainerSession

TRAINING, STOPPED = TrainerState.TRAINER_STATE_TRAINING, TrainerState.TRAINER_STATE_STOPPED


class OneRunTrainer(trainer_pb2_grpc.TrainerServicer):
    """Holds one run at a time, as TrainerCore does: StartRun of another is FAILED_PRECONDITION until StopRun,
    and Status without a run id names the run held.

    Until `answers_from` (monotonic) it answers nothing, as a trainer in a long step or a paused process:
    a call that arrives earlier is served then, unless its caller has given up by then, and a StopRun whose
    caller gave up is lost. Until `starting_until` the run held is still being started.
    """

    def __init__(self, held: str = "", step: int = 0, groups: int = 0) -> None:
        self.held, self.step, self.groups = held, step, groups
        self.answers_from = 0.0
        self.starting_until = 0.0
        self.stop_calls: list[str] = []
        self.stopped: dict[str, TrainerStatus] = {}

    def status(self, state: TrainerState) -> TrainerStatus:
        return TrainerStatus(
            run_id=self.held, state=state, step=self.step, weight_version=self.step, groups_trained=self.groups
        )

    async def _answer_when_able(self) -> None:
        # A caller that gives up meanwhile cancels this handler: its call is lost.
        await asyncio.sleep(max(0.0, self.answers_from - time.monotonic()))

    async def StartRun(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        await self._answer_when_able()
        starting = time.monotonic() < self.starting_until
        if self.held and (self.held != request.run_id or starting):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the trainer is busy with run {self.held}")
        self.held, self.step, self.groups = request.run_id, 0, 0
        return self.status(TRAINING)

    async def Status(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        await self._answer_when_able()
        if request.run_id and request.run_id != self.held:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this trainer has no run {request.run_id!r}")
        if not self.held:
            return TrainerStatus(state=TrainerState.TRAINER_STATE_IDLE)
        starting = time.monotonic() < self.starting_until
        return self.status(TrainerState.TRAINER_STATE_STARTING if starting else TRAINING)

    async def StopRun(self, request: Any, context: aio.ServicerContext) -> TrainerStatus:  # noqa: N802
        self.stop_calls.append(request.run_id)
        await self._answer_when_able()
        if request.run_id in self.stopped:
            return self.stopped[request.run_id]
        if request.run_id != self.held:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this trainer has no run {request.run_id!r}")
        final = self.stopped[request.run_id] = self.status(STOPPED)
        self.held = ""
        return final


async def _store(core: RunsCore, run_id: str, state: str, step: int = 0, groups: int = 0) -> None:
    progress = RunProgress(step=step, weight_version=step, groups_trained=groups, total_steps=200)
    await core.store.create(Run(id=run_id, state=state, progress=progress))


def test_a_cancel_the_trainer_cannot_answer_in_time_stops_the_run_once_it_can(redis_prefix: str) -> None:
    """The audit's flow, and its record: the trainer finished step 6 (48 groups) after the cancel froze the
    record at step 5 (40 groups); StopRun's answer brings the record to what the trainer did."""
    trainer = OneRunTrainer(held="run-a", step=6, groups=48)

    async def scenario() -> tuple[Run, TrainerStatus, float]:
        async with serve_trainer(trainer, call_timeout_s=0.3) as client, runs_core(redis_prefix) as core:
            await _store(core, "run-a", "RUN_STATE_RUNNING", step=5, groups=40)
            await _store(core, "run-b", "RUN_STATE_QUEUED")
            await core.cancel("run-a")
            trainer.answers_from = time.monotonic() + 1.0  # longer than three StopRun deadlines
            asked = time.monotonic()
            await session(client, core, "run-a").stop()  # what the run loop does for a cancelled run
            took = time.monotonic() - asked
            assert trainer.held == "", f"the trainer still holds {trainer.held} after StopRun {trainer.stop_calls}"
            return await core.get("run-a"), await session(client, core, "run-b").start(), took

    cancelled, started, took = asyncio.run(scenario())
    assert 1.0 <= took < 5 and len(trainer.stop_calls) >= 2
    assert started.run_id == "run-b" and trainer.held == "run-b"
    assert cancelled.state == RunState.RUN_STATE_CANCELLED
    p = cancelled.progress
    assert (p.step, p.weight_version, p.groups_trained) == (6, 6, 48)


@pytest.mark.parametrize("record", ["CANCELLED", "FAILED", "SUCCEEDED", "none"])
def test_a_run_that_finds_the_trainer_on_a_run_that_is_over_frees_it_and_starts(
    redis_prefix: str, record: str, caplog: pytest.LogCaptureFixture
) -> None:
    """E.g. the orchestrator died between recording CANCELLED and sending StopRun, or the stop's bound passed."""
    trainer = OneRunTrainer(held="run-x", step=6, groups=48)

    async def scenario() -> tuple[TrainerStatus, Run | None]:
        async with serve_trainer(trainer) as client, runs_core(redis_prefix) as core:
            if record != "none":
                await _store(core, "run-x", f"RUN_STATE_{record}", step=5, groups=40)
            started = await session(client, core, "run-b").start()
            return started, await core.get("run-x") if record != "none" else None

    with caplog.at_level(logging.WARNING, logger="rlfleet_rollout.trainer_release"):
        started, x = asyncio.run(scenario())
    assert started.run_id == "run-b" and trainer.held == "run-b" and trainer.stop_calls == ["run-x"]
    described = record if record != "none" else "unknown to the run records"
    assert f"the trainer was freed from run run-x ({described}); run run-b starts" in caplog.text
    if x is not None:
        assert x.state == RunState.Value(f"RUN_STATE_{record}") and x.progress.step == 6


@pytest.mark.parametrize("record", ["RUNNING", "QUEUED"])
def test_a_run_another_orchestrator_drives_is_not_taken_from_it(redis_prefix: str, record: str) -> None:
    trainer = OneRunTrainer(held="run-x", step=3)

    async def scenario() -> None:
        async with serve_trainer(trainer) as client, runs_core(redis_prefix) as core:
            await _store(core, "run-x", f"RUN_STATE_{record}")
            with pytest.raises(Conflict, match=f"busy with run run-x, which is {record}.*run run-b cannot start"):
                await session(client, core, "run-b").start()

    asyncio.run(scenario())
    assert trainer.held == "run-x" and trainer.stop_calls == []


def test_a_start_waits_for_the_trainer_still_starting_the_same_run(redis_prefix: str) -> None:
    """The StartRun of an orchestrator that stopped since is still loading the run when the next one asks."""
    trainer = OneRunTrainer(held="run-a")
    trainer.starting_until = time.monotonic() + 0.5

    async def scenario() -> TrainerStatus:
        async with serve_trainer(trainer) as client, runs_core(redis_prefix) as core:
            await _store(core, "run-a", "RUN_STATE_RUNNING")
            return await session(client, core, "run-a").start()

    started = asyncio.run(scenario())
    assert (started.run_id, started.state) == ("run-a", TRAINING) and trainer.stop_calls == []


@pytest.mark.parametrize("outcome", ["FAILED", "SUCCEEDED"])
def test_a_run_that_ends_is_recorded_over_before_the_trainer_is_stopped(
    redis_prefix: str, outcome: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's case: the run's end was known, but its record said RUNNING for as long as StopRun was retried
    (up to --step-timeout); a Cancel meanwhile replaced the failure with CANCELLED, and a restart resumed the
    run. Recorded first, the record is the durable note of the stop owed (`free` makes it up after a restart)."""

    async def drive(run: Run, session: TrainerSession, deps: run_loop.RunDeps) -> None:
        if outcome == "FAILED":
            raise Internal("the trainer failed: boom")

    monkeypatch.setattr(run_loop, "_drive", drive)

    async def scenario() -> tuple[Run, StopOnlyTrainer]:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED, stalled="no progress for 9 s"))
            trainer = StopOnlyTrainer(core, unreachable=3)
            await asyncio.wait_for(run_loop.execute_run("run-a", run_deps(core, trainer)), timeout=10)
            return await core.get("run-a"), trainer

    final, trainer = asyncio.run(scenario())
    assert trainer.states_seen == [outcome] * 4, "StopRun was asked before the run's end was recorded"
    assert trainer.cancel_answer.startswith(f"Conflict: run run-a already {outcome}")
    assert RunState.Name(final.state) == f"RUN_STATE_{outcome}" and final.stalled == ""
    assert final.error == ("the trainer failed: boom" if outcome == "FAILED" else "")
    assert final.progress.step == 4, "the trainer's final progress is recorded once it has stopped"


def test_a_run_cancelled_while_its_end_is_recorded_still_has_its_trainer_stopped(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Cancel lands while the run's final record is being written (a slow Redis): the run's task is cancelled
    there. Before, that skipped the trainer's StopRun, and the trainer held the ended run."""

    async def drive(run: Run, session: TrainerSession, deps: run_loop.RunDeps) -> None:
        return None

    monkeypatch.setattr(run_loop, "_drive", drive)

    async def scenario() -> StopOnlyTrainer:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED))
            trainer = StopOnlyTrainer(core)
            update, writes, recording = core.update, [], asyncio.Event()

            async def slow_final_record(run_id: str, mutate: Any, **options: Any) -> Run:
                writes.append(options)
                if len(writes) == 2:  # the final record (after RUNNING): Redis is slow
                    recording.set()
                    await asyncio.sleep(30)
                return await update(run_id, mutate, **options)

            monkeypatch.setattr(core, "update", slow_final_record)
            task = asyncio.create_task(run_loop.execute_run("run-a", run_deps(core, trainer)))
            await asyncio.wait_for(recording.wait(), timeout=10)
            await core.cancel("run-a")
            task.cancel()  # as the run queue does for a cancelled run
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=10)
            return trainer

    trainer = asyncio.run(scenario())
    assert trainer.states_seen == ["CANCELLED"], "the trainer was not stopped"
