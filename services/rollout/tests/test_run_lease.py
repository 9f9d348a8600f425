"""The lease that says which orchestrator drives a run: one holder at a time, renewed only by its holder, taken
over once a holder that stopped renewing it (it died) lets it run out, and a holder that lost it stops driving."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from rollout_test_support import REDIS_URL
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core

from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout import run_queue
from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.run_lease import RunLease
from rlfleet_rollout.run_queue import RunQueue

TTL_S = 0.4


@contextlib.asynccontextmanager
async def _leases(prefix: str) -> AsyncIterator[tuple[RunLease, RunLease]]:
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        yield (
            RunLease(client, prefix, ttl_s=TTL_S, token="orchestrator-a"),
            RunLease(client, prefix, ttl_s=TTL_S, token="orchestrator-b"),
        )
    finally:
        await client.aclose()


def test_one_orchestrator_holds_a_run_until_it_lets_go(redis_prefix: str) -> None:
    async def scenario() -> None:
        async with _leases(redis_prefix) as (a, b):
            assert await a.hold("run-1")
            assert not await b.hold("run-1")
            assert await a.hold("run-1"), "the holder renews its own lease"
            assert await b.others(["run-1", "run-2"]) == {"run-1": "orchestrator-a"}
            assert await a.others(["run-1", "run-2"]) == {}, "its own lease is no other's"
            await b.release("run-1")  # not b's to release
            assert not await b.hold("run-1")
            await a.release("run-1")
            assert await b.hold("run-1")
            assert await a.others(["run-1"]) == {"run-1": "orchestrator-b"}

    asyncio.run(scenario())


def test_a_lease_its_holder_stopped_renewing_runs_out_and_is_taken_over(redis_prefix: str) -> None:
    async def scenario() -> None:
        async with _leases(redis_prefix) as (a, b):
            assert await a.hold("run-1")
            await asyncio.sleep(TTL_S * 1.5)  # a died: nobody renews its lease
            assert await b.others(["run-1"]) == {}
            assert await b.hold("run-1")
            assert not await a.hold("run-1"), "a lease taken over is not given back"

    asyncio.run(scenario())


def test_the_driver_renews_its_lease_and_stops_driving_once_another_holds_it(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with _leases(redis_prefix) as (a, b):
            assert await a.hold("run-1")
            driving = asyncio.create_task(asyncio.sleep(60))
            keeper = asyncio.create_task(a.keep("run-1", driving))
            await asyncio.sleep(TTL_S * 3)
            assert not await b.hold("run-1"), "renewed every quarter of its time, the lease never ran out"
            assert not driving.done()
            # As after an outage longer than the lease: it ran out, and b took it before a renewed it.
            await b.client.delete(b.key("run-1"))
            assert await b.hold("run-1")
            await asyncio.wait_for(keeper, timeout=TTL_S * 2)
            assert driving.cancelled()

    asyncio.run(scenario())
    assert "orchestrator orchestrator-b holds the lease of run run-1 now" in caplog.text


def test_a_queue_that_left_a_run_to_another_orchestrator_takes_it_over_as_that_lease_runs_out(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the queue looked again only at its idle recheck (5 s), however soon the dead holder's lease ran out."""
    driven: list[float] = []

    async def drive(run_id: str, deps: object) -> None:
        driven.append(time.monotonic())
        await asyncio.sleep(3600)

    monkeypatch.setattr(run_queue, "execute_run", drive)

    async def scenario() -> float:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            dead = RunLease(core.store.client, redis_prefix, ttl_s=1.0, token="orchestrator-that-died")
            assert await dead.hold("run-a")
            left_at = time.monotonic()
            mine = RunLease(core.store.client, redis_prefix, ttl_s=1.0, token="orchestrator-b")
            queue = RunQueue(run_deps(core, StopOnlyTrainer(core)), mine)
            monkeypatch.setattr(queue, "_free_trainer", _nothing)
            serving = asyncio.create_task(queue.serve())
            try:
                deadline = time.monotonic() + 10
                while not driven:
                    assert not serving.done(), f"the queue ended: {serving.exception()!r}"
                    assert time.monotonic() < deadline, "the run was never taken over"
                    await asyncio.sleep(0.02)
            finally:
                await cancel_and_wait(serving)
            return driven[0] - left_at

    taken_after = asyncio.run(scenario())
    assert 0.9 < taken_after < 2.0, f"taken over {taken_after:.2f}s after its lease of 1 s was last renewed"


async def _nothing() -> None:
    return None
