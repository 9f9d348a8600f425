"""The lease that says which orchestrator drives a run: one holder at a time, renewed only by its holder, taken
over once a holder that stopped renewing it (it died) lets it run out, and a holder that lost it stops driving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from rollout_test_support import REDIS_URL

from rlfleet_rollout.run_lease import RunLease

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
