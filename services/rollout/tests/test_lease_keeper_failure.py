"""A lease keeper that fails (a fault of ours, not Redis) stops its run's driver, as a lost lease does.

The case: `RunLease.keep` tried again on Redis errors alone; any other exception ended the keeper's task, and
nothing looked at it: the driver drove on with a lease nobody renewed, which ran out in Redis, so that another
orchestrator could take the run over and two drove it at once. The run queue, which starts both, now stops the
driver when the keeper ends first, and leaves the run RUNNING to whichever orchestrator takes its lease next.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core

from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout import run_queue
from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.run_lease import RunLease
from rlfleet_rollout.run_queue import RunQueue

TTL_S = 1.0


class FailingRenewal(RunLease):
    """A lease whose `failures` renewals after the first hold raise an error of no Redis kind."""

    def __init__(self, *args: object, failures: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.failures = failures
        self.holds = 0

    async def hold(self, run_id: str) -> bool:
        self.holds += 1
        if self.holds > 1 and self.failures > 0:
            self.failures -= 1
            raise ValueError("renewal went wrong")
        return await super().hold(run_id)


async def _nothing() -> None:
    return None


def test_a_lease_keeper_that_fails_stops_the_driver_and_leaves_the_run_running(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    drives: list[tuple[float, float | None]] = []  # when each drive of the run started, and when it was stopped

    async def drive(run_id: str, deps: object) -> None:
        drives.append((time.monotonic(), None))
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            drives[-1] = (drives[-1][0], time.monotonic())
            raise

    monkeypatch.setattr(run_queue, "execute_run", drive)

    async def scenario() -> tuple[RunState, str | None, bool, list[tuple[float, float | None]]]:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            lease = FailingRenewal(core.store.client, redis_prefix, ttl_s=TTL_S, token="orchestrator-a", failures=1)
            queue = RunQueue(run_deps(core, StopOnlyTrainer(core)), lease)
            monkeypatch.setattr(queue, "_free_trainer", _nothing)
            serving = asyncio.create_task(queue.serve())
            try:
                deadline = time.monotonic() + 10
                # Driven, stopped when its keeper failed, then driven again (the failure was once).
                while len(drives) < 2:
                    assert not serving.done(), f"the queue ended: {serving.exception()!r}"
                    assert time.monotonic() < deadline, f"the run was not stopped and driven again: {drives}"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(TTL_S)  # the second keeper renews the lease past its first time
                state = (await core.store.get("run-a")).state
                holder = await core.store.client.get(lease.key("run-a"))
                return state, holder.decode() if holder else None, not serving.done(), list(drives)
            finally:
                await cancel_and_wait(serving)

    with caplog.at_level(logging.ERROR, logger="rlfleet_rollout.run_queue"):
        state, holder, serving, drives_then = asyncio.run(scenario())
    first_start, first_stop = drives_then[0]
    assert first_stop is not None, "the driver drove on after its lease keeper failed"
    # Stopped at the keeper's first renewal (a quarter of the lease's time), well before the lease could run out.
    assert first_stop - first_start < TTL_S * 0.6, f"stopped {first_stop - first_start:.2f}s after it started"
    assert len(drives_then) == 2 and drives_then[1][1] is None, "the run, resumed, is driven on"
    assert state == RunState.RUN_STATE_RUNNING, "the run was left RUNNING for the next driver"
    assert holder == "orchestrator-a" and serving
    failures = [r for r in caplog.records if "lease" in r.getMessage() and r.exc_info]
    assert len(failures) == 1, caplog.text
    assert "run-a" in failures[0].getMessage() and "renewal went wrong" in caplog.text


class FailingAsTheRunEnds(RunLease):
    """A lease whose first renewal ends the run's drive (sets `ended`) and fails in the same instant."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ended = asyncio.Event()
        self.holds = 0

    async def hold(self, run_id: str) -> bool:
        self.holds += 1
        if self.holds == 2:
            self.ended.set()
            raise ValueError("renewal went wrong")
        return await super().hold(run_id)


def test_a_lease_keeper_that_fails_as_the_run_ends_is_logged_once_and_its_failure_retrieved(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the run queue looked at the keeper only when it ended first: one that failed as the run's task ended
    was not looked at, nothing logged its failure, and asyncio reported it later (when the task was collected) as
    "Task exception was never retrieved"."""
    unhandled: list[str] = []
    outlived: list[str] = []
    drives = 0

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context["message"]))
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            lease = FailingAsTheRunEnds(core.store.client, redis_prefix, ttl_s=0.2, token="orchestrator-a")

            async def drive(run_id: str, deps: object) -> None:
                nonlocal drives
                drives += 1
                if drives == 1:
                    await lease.ended.wait()  # the run's task ends as its keeper fails
                else:
                    await asyncio.sleep(3600)

            monkeypatch.setattr(run_queue, "execute_run", drive)
            queue = RunQueue(run_deps(core, StopOnlyTrainer(core)), lease)
            monkeypatch.setattr(queue, "_free_trainer", _nothing)
            serving = asyncio.create_task(queue.serve())
            try:
                deadline = time.monotonic() + 10
                while drives < 2:
                    assert not serving.done(), f"the queue ended: {serving.exception()!r}"
                    assert time.monotonic() < deadline, "the run was not driven again"
                    await asyncio.sleep(0.02)
            finally:
                await cancel_and_wait(serving)
            # Nothing the queue started outlives it (a task cancelled once only can lose its cancellation in redis-py).
            left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in left:
                await cancel_and_wait(task, within_s=2)
            outlived.extend(task.get_name() for task in left)
            del serving, left
            gc.collect()  # every task of the first drive is garbage now: one whose failure nobody retrieved says so
            await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="rlfleet_rollout.run_queue"):
        asyncio.run(scenario())
    assert unhandled == [], f"asyncio reported: {unhandled}"
    assert outlived == [], f"tasks of the run queue outlived it: {outlived}"
    failures = [r for r in caplog.records if r.exc_info and "renewal went wrong" in str(r.exc_info[1])]
    assert len(failures) == 1, caplog.text
    assert "run-a" in failures[0].getMessage() and "lease keeper failed" in failures[0].getMessage()
