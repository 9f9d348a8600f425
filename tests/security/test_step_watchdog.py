"""The step watchdog reports a run that stopped moving (a run event and metrics) and clears the report
when it moves again; it never ends the run itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rlfleet.v1.runs_pb2 import Run, RunProgress, RunSpec, RunState
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_events import describe_change
from rlfleet_rollout.runs_core import RunEnded
from rlfleet_rollout.step_watchdog import watch_progress


class Records:
    """Runs kept in memory, with the run-ended rule of RunsCore.update; every written run is kept."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.history: list[Run] = [self._copy(run)]

    @staticmethod
    def _copy(run: Run) -> Run:
        out = Run()
        out.CopyFrom(run)
        return out

    async def get(self, run_id: str) -> Run:
        return self._copy(self.run)

    async def update(self, run_id: str, mutate: Callable[[Run], None]) -> Run:
        if self.run.state != RunState.RUN_STATE_RUNNING:
            raise RunEnded(f"run {run_id} ended")
        mutate(self.run)
        self.history.append(self._copy(self.run))
        return self._copy(self.run)


def running_run() -> Run:
    spec = RunSpec()
    spec.rollout.groups_per_step = 2
    return Run(id="run-1", spec=spec, state=RunState.RUN_STATE_RUNNING, progress=RunProgress(step=3, total_steps=10))


def stall_count(metrics: RolloutMetrics) -> float:
    value = metrics.registry.get_sample_value("rlfleet_rollout_step_stalls_total")
    assert value is not None
    return value


def test_a_stall_is_reported_once_then_cleared_when_the_run_moves() -> None:
    async def scenario() -> tuple[Records, RolloutMetrics, float]:
        records, metrics = Records(running_run()), RolloutMetrics()
        watchdog = asyncio.create_task(watch_progress(records, metrics, "run-1", stall_after_s=0.4))
        await asyncio.sleep(1.2)  # three times the bound: still one report
        idle = metrics.seconds_without_progress._value.get()
        assert records.run.stalled.startswith("no progress for"), records.run.stalled
        assert "at step 3 of 10" in records.run.stalled and "producing its groups" in records.run.stalled
        assert stall_count(metrics) == 1
        records.run.progress.groups_produced = 2  # the loop records progress
        await asyncio.sleep(0.4)
        assert records.run.stalled == ""
        assert metrics.seconds_without_progress._value.get() < 0.4
        records.run.state = RunState.RUN_STATE_SUCCEEDED
        await asyncio.sleep(1.0)  # stalls again, but the run ended: the watchdog stops on its own
        await asyncio.wait_for(watchdog, timeout=2)
        return records, metrics, idle

    records, metrics, idle = asyncio.run(scenario())
    assert idle >= 0.4
    assert metrics.seconds_without_progress._value.get() == 0
    messages = [describe_change(a, b) for a, b in zip(records.history, records.history[1:], strict=False)]
    assert messages[0].startswith("run run-1: no progress for"), messages
    assert messages[1] == "run run-1 makes progress again", messages


def test_a_note_an_earlier_orchestrator_left_is_cleared_once_the_run_moves() -> None:
    """After a restart or a lease taken over, the new watchdog cleared only notes it wrote itself: the run's
    record said `no progress` until it ended, however it moved."""

    async def scenario() -> Records:
        run = running_run()
        run.stalled = "no progress for 600 s at step 3 of 10: producing its groups"
        records, metrics = Records(run), RolloutMetrics()
        watchdog = asyncio.create_task(watch_progress(records, metrics, "run-1", stall_after_s=0.8))
        await asyncio.sleep(0.5)  # looked at, not moved: the note stands
        assert records.run.stalled.startswith("no progress for 600 s")
        records.run.progress.groups_produced = 2
        await asyncio.sleep(0.5)
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
        return records

    records = asyncio.run(scenario())
    assert records.run.stalled == ""
    assert [r.stalled for r in records.history[1:]] == [""], "cleared once, nothing else written"


def test_samples_generated_count_as_progress() -> None:
    async def scenario() -> RolloutMetrics:
        records, metrics = Records(running_run()), RolloutMetrics()
        watchdog = asyncio.create_task(watch_progress(records, metrics, "run-1", stall_after_s=0.4))
        for _ in range(10):  # a sample every 0.1 s: a slow step, not a stuck one
            metrics.samples.labels(status="ok").inc()
            await asyncio.sleep(0.1)
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
        assert records.run.stalled == ""
        return metrics

    assert stall_count(asyncio.run(scenario())) == 0
