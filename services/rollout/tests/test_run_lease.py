"""The lease that says which orchestrator drives a run: one holder at a time, renewed only by its holder, taken
over once a holder that stopped renewing it (it died) lets it run out, and a holder that lost it stops driving."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis_partition import RedisPartition
from rollout_test_support import REDIS_URL
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core

from rlfleet.sample_stream import connect_redis_async
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


def test_a_run_cancelled_through_another_orchestrator_stops_being_driven_here(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Cancel reached the driver only through the run's record, which the run loop writes once per step: it
    generated on for the cancelled run (20 s and more with slow engines) while the other freed the trainer."""
    cancelled_at: list[float] = []

    async def drive(run_id: str, deps: object) -> None:
        try:
            await asyncio.sleep(3600)  # a step whose generations take long: the run loop writes nothing meanwhile
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            raise

    monkeypatch.setattr(run_queue, "execute_run", drive)

    async def scenario() -> float:
        async with runs_core(redis_prefix) as driver, runs_core(redis_prefix) as other:
            await driver.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            lease = RunLease(driver.store.client, redis_prefix, ttl_s=5.0, token="orchestrator-a")
            queue = RunQueue(run_deps(driver, StopOnlyTrainer(driver)), lease)
            monkeypatch.setattr(queue, "_free_trainer", _nothing)
            serving = asyncio.create_task(queue.serve())
            try:
                deadline = time.monotonic() + 10
                while queue._active_task is None:
                    assert not serving.done(), f"the queue ended: {serving.exception()!r}"
                    assert time.monotonic() < deadline, "the run was never driven"
                    await asyncio.sleep(0.01)
                await other.cancel("run-a")
                answered_at = time.monotonic()
                while not cancelled_at:
                    assert time.monotonic() < answered_at + 5, "the driver never saw the Cancel another answered"
                    await asyncio.sleep(0.01)
            finally:
                await cancel_and_wait(serving)
            return cancelled_at[0] - answered_at

    seen_after = asyncio.run(scenario())
    assert seen_after < 1.0, f"the driver stopped the run {seen_after:.2f}s after the Cancel"


def test_a_driver_cut_off_redis_stops_driving_before_another_can_take_the_run_over(redis_prefix: str) -> None:
    """A partition between one orchestrator and Redis. Before, its renewal waited out the Redis client's 30 s of
    retries while the other orchestrator took the run over once the lease ran out, and the first drove on (and, once
    Redis answered again, recorded the run FAILED, "Redis was unreachable", under the one driving it)."""
    partition = RedisPartition(REDIS_URL)

    async def scenario() -> tuple[float, float]:
        cut_off_client = connect_redis_async(partition.url)  # the orchestrator's own client, with its retries
        direct = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            cut_off = RunLease(cut_off_client, redis_prefix, ttl_s=1.0, token="orchestrator-a")
            other = RunLease(direct, redis_prefix, ttl_s=1.0, token="orchestrator-b")
            assert await cut_off.hold("run-1")
            driving = asyncio.create_task(asyncio.sleep(60))
            stopped: list[float] = []
            driving.add_done_callback(lambda _: stopped.append(time.monotonic()))
            keeper = asyncio.create_task(cut_off.keep("run-1", driving))
            await asyncio.sleep(0.6)  # renewed at least twice
            partition.cut()
            deadline = time.monotonic() + 5
            while not await other.hold("run-1"):
                assert time.monotonic() < deadline, "the lease of the orchestrator cut off Redis never ran out"
                await asyncio.sleep(0.01)
            taken_at = time.monotonic()
            assert stopped, "the orchestrator cut off Redis still drove the run once another took it over"
            assert driving.cancelled()
            partition.heal()
            await asyncio.wait_for(keeper, timeout=5)
            assert await other.others(["run-1"]) == {}, "the run stays with the one that took it over"
            return stopped[0], taken_at
        finally:
            partition.heal()
            await cut_off_client.aclose()
            await direct.aclose()

    try:
        stopped_at, taken_at = asyncio.run(scenario())
    finally:
        partition.close()
    assert stopped_at < taken_at


async def _nothing() -> None:
    return None
