"""The run store against the real Redis: creation order, state filter, pagination, bad tokens, and what a run
that ends leaves behind."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from rollout_test_support import REDIS_URL
from trainer_release_support import runs_core

from rlfleet.errors import InvalidInput, NotFound
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.run_data import DataPosition, data_position_key
from rlfleet_rollout.run_store import RunStore

QUEUED, RUNNING = RunState.RUN_STATE_QUEUED, RunState.RUN_STATE_RUNNING


def test_pages_follow_creation_order_and_filter_by_state(redis_prefix: str) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = RunStore(client, redis_prefix)
        try:
            for i in range(7):
                await store.create(Run(id=f"r{i}", state=QUEUED if i % 2 else RUNNING))
            first, token = await store.page(page_size=3)
            second, token2 = await store.page(page_size=3, page_token=token)
            third, token3 = await store.page(page_size=3, page_token=token2)
            assert [r.id for r in first + second + third] == [f"r{i}" for i in range(7)]
            assert token and token2 and token3 == ""
            queued, qtoken = await store.page(QUEUED, page_size=2)
            rest, qtoken2 = await store.page(QUEUED, page_size=2, page_token=qtoken)
            assert [r.id for r in queued + rest] == ["r1", "r3", "r5"] and qtoken2 == ""
            exact, last = await store.page(RUNNING, page_size=4)
            assert len(exact) == 4 and last == ""  # no empty page after the last run
            run = await store.get("r3")
            run.state = RUNNING
            await store.put(run)
            assert [r.id for r in await store.all_in_order([QUEUED])] == ["r1", "r5"]
            with pytest.raises(NotFound):
                await store.get("r99")
            with pytest.raises(InvalidInput, match="page_token"):
                await store.page(page_token="abc")
            with pytest.raises(InvalidInput, match="page_size"):
                await store.page(page_size=5000)
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_next_page_token_is_given_only_when_a_run_of_the_page_kind_follows(redis_prefix: str) -> None:
    """The audit's repro: with a state filter, a page that ended on the last matching run still handed
    out a token (it counted every later run, matching or not), and that token led to an empty page."""
    succeeded, failed = RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = RunStore(client, redis_prefix)
        try:
            states = [succeeded, QUEUED, succeeded, failed, RUNNING, QUEUED]
            for i, state in enumerate(states):
                await store.create(Run(id=f"r{i}", state=state))
            first, token = await store.page(succeeded, page_size=1)
            assert [r.id for r in first] == ["r0"] and token
            second, token2 = await store.page(succeeded, page_size=1, page_token=token)
            assert [r.id for r in second] == ["r2"] and token2 == ""  # r3..r5 are not SUCCEEDED
            only, none_after = await store.page(failed, page_size=1)
            assert [r.id for r in only] == ["r3"] and none_after == ""
            # A run whose record is gone (deleted behind the store's back) is no "next" run either.
            await client.delete(store.record_key("r5"))
            head, rest = await store.page(page_size=5)
            assert [r.id for r in head] == [f"r{i}" for i in range(5)] and rest == ""
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_run_that_ends_leaves_its_working_data_to_expire_and_keeps_its_record(
    redis_prefix: str, redis_client: redis.Redis
) -> None:
    """Every run's stream, dead letters and data position stayed in Redis for ever after the run ended."""
    stream = SampleStream(redis_client, "r1", prefix=redis_prefix)
    stream.ensure_consumer_group()
    DataPosition(redis_client, "r1", prefix=redis_prefix).record_end(0, 4, [0, 1])
    working = [stream.key, data_position_key("r1", redis_prefix)]

    async def scenario() -> None:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="r1", state=RUNNING))
            await core.update("r1", lambda run: run.progress.SetInParent())
            assert [redis_client.ttl(key) for key in working] == [-1, -1]  # running: kept
            await core.cancel("r1")
            assert all(0 < redis_client.ttl(key) <= 60 for key in working)
            assert redis_client.ttl(core.store.record_key("r1")) == -1

    asyncio.run(scenario())
