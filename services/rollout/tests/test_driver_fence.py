"""A driver's writes of its run's record land only while the run is its own: two orchestrators on one Redis, and a
Redis that loses writes.

The cases:
- another orchestrator took the run's lease (the first one's lease key lost in a failover, or the first paused past
  its lease's time): the first drove on, writing the run's record under the new driver's writes, until its keeper's
  next renewal, a quarter of the lease's time later (and a task of its that outlived its cancellation, longer);
- the run's record vanished (Redis restarted without persistence): the driver recorded the run FAILED ("run not
  found"), which failed too, and the queue logged it as interrupted, to be picked again; nothing stopped the trainer,
  which held the run until another run's start found it busy;
- the run's record went back in time (a failover to a replica that was behind): the driver wrote on over the older
  record, unaware.
Now each write checks the run's lease and the record's revision in its own transaction (run_fence.py), and a driver
refused stops at once, leaving the run as its records say.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
from trainer_release_support import run_deps, runs_core

from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus
from rlfleet_rollout import run_loop
from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.run_lease import RunLease
from rlfleet_rollout.run_queue import RunQueue
from rlfleet_rollout.runs_core import RunsCore

TTL_S = 8.0  # its keeper renews (and looks) every 2 s: far later than any write the tests watch for
WRITE_EVERY_S = 0.02


class HoldingTrainer:
    """The trainer as the run queue sees it: busy with the run driven (set by the driver), freed by StopRun."""

    def __init__(self) -> None:
        self.holding = ""
        self.stopped: list[str] = []

    async def held(self) -> TrainerStatus:
        return TrainerStatus(run_id=self.holding)

    async def stop_run(self, run_id: str) -> TrainerStatus:
        self.stopped.append(run_id)
        self.holding = ""
        return TrainerStatus(run_id=run_id, state=TrainerState.TRAINER_STATE_STOPPED)


def _bump(run: Run) -> None:
    """A write of the driver's, as its progress and metrics are: it counts itself in the record."""
    run.metrics["writes"] = run.metrics["writes"] + 1


class Drives:
    """A run loop whose `_drive` writes the run's record every WRITE_EVERY_S, as the real one does at every step and
    trainer poll; each drive's start and how it ended are noted."""

    def __init__(self, trainer: HoldingTrainer) -> None:
        self.trainer = trainer
        self.started: list[float] = []
        self.ended: list[str] = []

    async def drive(self, run: Run, session: object, deps: run_loop.RunDeps) -> None:
        self.started.append(time.monotonic())
        self.trainer.holding = run.id
        try:
            while True:
                await deps.core.update(run.id, _bump)
                await asyncio.sleep(WRITE_EVERY_S)
        except BaseException as exc:
            self.ended.append(type(exc).__name__)
            raise


async def _until(condition: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def _writes(core: RunsCore) -> float:
    return (await core.store.get("run-a")).metrics["writes"]


async def _drove(core: RunsCore) -> bool:
    return await _writes(core) >= 3


async def _writes_past(core: RunsCore, earlier: Run) -> bool:
    return await _writes(core) >= earlier.metrics["writes"] + 3


def _serve(core: RunsCore, trainer: HoldingTrainer, token: str) -> tuple[RunLease, asyncio.Task[None]]:
    lease = RunLease(core.store.client, core.store.prefix, ttl_s=TTL_S, token=token)
    queue = RunQueue(run_deps(core, trainer), lease)  # type: ignore[arg-type]
    return lease, asyncio.create_task(queue.serve())


def test_no_write_of_a_driver_lands_once_another_orchestrator_holds_the_run(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = HoldingTrainer()
    drives = Drives(trainer)
    monkeypatch.setattr(run_loop, "_drive", drives.drive)

    async def scenario() -> tuple[float, Run, str, bool]:
        async with runs_core(redis_prefix) as core_a, runs_core(redis_prefix) as core_b:
            await core_a.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            lease_a, serving = _serve(core_a, trainer, "orchestrator-a")
            try:
                await _until(lambda: _drove(core_a), 5, "orchestrator a never drove")
                # Orchestrator b takes the run's lease while a's keeper has not looked yet: a's lease key was lost
                # (a failover), or a was paused past its lease's time.
                lease_b = RunLease(core_b.store.client, redis_prefix, ttl_s=TTL_S, token="orchestrator-b")
                await core_b.store.client.delete(lease_b.key("run-a"))
                assert await lease_b.hold("run-a")
                # b's first write of the run notes how many of a's it found.
                seen_by_b = (await core_b.update("run-a", _bump)).metrics["writes"]
                await asyncio.sleep(0.5)  # 25 of a's writes, had it written on
                record = await core_b.store.get("run-a")
                holder = (await core_b.store.client.get(lease_b.key("run-a"))).decode()
                return seen_by_b, record, holder, serving.done()
            finally:
                await cancel_and_wait(serving)

    with caplog.at_level(logging.INFO, logger="rlfleet_rollout"):
        seen_by_b, record, holder, queue_ended = asyncio.run(scenario())
    assert record.metrics["writes"] == seen_by_b, (
        f"orchestrator a wrote the run {record.metrics['writes'] - seen_by_b:.0f} times after b took it over"
    )
    assert drives.ended[:1] == ["LeaseLost"], f"a's driver did not stop at its first write refused: {drives.ended}"
    assert len(drives.started) == 1, "a drove the run again while b held it"
    assert record.state == RunState.RUN_STATE_RUNNING and not record.error, "the run is b's to end, not a's"
    assert holder == "orchestrator-b" and not queue_ended
    assert trainer.stopped == [], "a stopped the trainer of the run b drives"
    refused = [r.getMessage() for r in caplog.records if "orchestrator-b" in r.getMessage()]
    assert refused and "stopped driving" in refused[0], caplog.text


def test_a_run_whose_record_vanished_is_neither_recreated_nor_failed_and_its_trainer_is_freed(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = HoldingTrainer()
    drives = Drives(trainer)
    monkeypatch.setattr(run_loop, "_drive", drives.drive)

    async def scenario() -> tuple[list[bytes], bool, float]:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            _, serving = _serve(core, trainer, "orchestrator-a")
            try:
                await _until(lambda: _drove(core), 5, "the run was never driven")
                # Redis restarted without persistence: every key of the fleet is gone.
                lost_at = time.monotonic()
                keys = [key async for key in core.store.client.scan_iter(match=f"{redis_prefix}*")]
                await core.store.client.delete(*keys)

                async def freed() -> bool:
                    return trainer.stopped == ["run-a"]

                await _until(freed, 5, f"the trainer still holds the run whose record vanished: {trainer.stopped}")
                freed_after = time.monotonic() - lost_at
                await asyncio.sleep(0.2)
                left = [key async for key in core.store.client.scan_iter(match=f"{redis_prefix}run:run-a:*")]
                return left, serving.done(), freed_after
            finally:
                await cancel_and_wait(serving)

    with caplog.at_level(logging.INFO, logger="rlfleet_rollout"):
        left, queue_ended, freed_after = asyncio.run(scenario())
    assert left == [], f"keys of the vanished run were written again: {left}"
    assert drives.ended == ["RecordLost"] and len(drives.started) == 1
    assert not queue_ended
    assert freed_after < 3.0
    messages = [r.getMessage() for r in caplog.records]
    assert any("record is gone" in m and "stopped driving" in m for m in messages), caplog.text
    assert not any("failed" in m and "not found" in m for m in messages), "the vanished run was taken for failed"


def test_a_driver_whose_run_record_went_back_in_time_stops_and_the_run_is_resumed_from_its_records(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = HoldingTrainer()
    drives = Drives(trainer)
    monkeypatch.setattr(run_loop, "_drive", drives.drive)

    async def scenario() -> tuple[float, Run, bool]:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            client = core.store.client
            _, serving = _serve(core, trainer, "orchestrator-a")
            try:
                await _until(lambda: _drove(core), 5, "the run was never driven")
                keys = [core.store.record_key("run-a"), f"{redis_prefix}run:run-a:revision"]
                earlier = await client.mget(keys)  # as a replica that is behind holds it
                await _until(lambda: _writes_past(core, Run.FromString(earlier[0])), 5, "the driver stopped writing")
                # Failed over to that replica (a record written before revisions were counted has none).
                await client.mset({key: value for key, value in zip(keys, earlier, strict=True) if value is not None})
                restored_at = time.monotonic()

                async def resumed() -> bool:
                    return len(drives.started) == 2

                await _until(resumed, 5, f"the run was not picked again from its records: {drives.ended}")
                return drives.started[1] - restored_at, await core.store.get("run-a"), serving.done()
            finally:
                await cancel_and_wait(serving)

    with caplog.at_level(logging.INFO, logger="rlfleet_rollout"):
        resumed_after, record, queue_ended = asyncio.run(scenario())
    assert drives.ended[:1] == ["RecordLost"], drives.ended
    assert resumed_after < 3.0 and not queue_ended
    assert record.state == RunState.RUN_STATE_RUNNING and not record.error
    assert trainer.stopped == [], "the trainer of a run still RUNNING in its records was stopped"
    assert any("went back" in r.getMessage() for r in caplog.records), caplog.text
