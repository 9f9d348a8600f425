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
from rlfleet_rollout.run_data import DataPosition, StepCounts, data_position_key
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunEnded

QUEUED, RUNNING = RunState.RUN_STATE_QUEUED, RunState.RUN_STATE_RUNNING
CANCELLED, FAILED = RunState.RUN_STATE_CANCELLED, RunState.RUN_STATE_FAILED


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
            await store.update("r3", lambda run: setattr(run, "state", RUNNING), expire_data_after_s=60)
            assert [r.id for r in await store.all_in_order([QUEUED])] == ["r1", "r5"]
            with pytest.raises(NotFound):
                await store.get("r99")
            with pytest.raises(InvalidInput, match="page_token"):
                await store.page(page_token="abc")
            with pytest.raises(InvalidInput, match="page_token"):  # a digit to str.isdigit, not to int()
                await store.page(page_token="\u00b2")
            with pytest.raises(InvalidInput, match="page_token"):  # past int()'s 4,300 digits: was a 500
                await store.page(page_token="9" * 5000)
            with pytest.raises(InvalidInput, match="page_size"):
                await store.page(page_size=5000)
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_run_created_while_another_is_listed_first_is_not_ordered_before_it(redis_prefix: str) -> None:
    """A client that pages on from the last run it listed finds every run created since."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = RunStore(client, redis_prefix)
        slow_write = asyncio.Event()
        incr = client.incr

        async def slow_after_the_first_number(name: bytes | str | memoryview, amount: int = 1) -> int:
            number = await incr(name, amount)
            if number == 1:
                await slow_write.wait()
            return number

        client.incr = slow_after_the_first_number  # type: ignore[method-assign]
        try:
            first = asyncio.create_task(store.create(Run(id="first", state=QUEUED)))
            await asyncio.sleep(0.05)
            await store.create(Run(id="second", state=QUEUED))
            listed = [run.id for run in (await store.page())[0]]
            slow_write.set()
            await asyncio.wait_for(first, 5)
            final = [run.id for run in (await store.page())[0]]
            assert final[: len(listed)] == listed, (listed, final)
        finally:
            slow_write.set()
            await client.aclose()

    asyncio.run(scenario())


def test_a_next_page_token_is_given_only_when_a_run_of_the_page_kind_follows(redis_prefix: str) -> None:
    """Before, with a state filter, a page that ended on the last matching run still handed out a token (it
    counted every later run, matching or not), and that token led to an empty page."""
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


def test_a_page_of_large_runs_ends_early_and_its_token_leads_on(redis_prefix: str) -> None:
    """Runs hold their specs (inline prompts too) and evaluations: before, a page of 50 of them could pass the
    4 MiB a gRPC client takes by default, and ListRuns failed for it with RESOURCE_EXHAUSTED."""

    async def scenario() -> list[list[str]]:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = RunStore(client, redis_prefix)
        try:
            for i in range(5):
                await store.create(Run(id=f"big{i}", state=QUEUED, error="x" * (900 * 1024)))
            await store.create(Run(id="huge", state=QUEUED, error="x" * (3 * 1024 * 1024)))
            await store.create(Run(id="small", state=QUEUED))
            pages, token = [], ""
            while True:
                page, token = await store.page(page_size=1000, page_token=token)
                pages.append([r.id for r in page])
                if not token:
                    return pages
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [["big0", "big1"], ["big2", "big3"], ["big4"], ["huge"], ["small"]]


def test_a_run_that_ends_leaves_its_working_data_to_expire_and_keeps_its_record(
    redis_prefix: str, redis_client: redis.Redis
) -> None:
    """Every run's stream, dead letters and data position stayed in Redis for ever after the run ended."""
    stream = SampleStream(redis_client, "r1", prefix=redis_prefix)
    stream.ensure_consumer_group()
    DataPosition(redis_client, "r1", prefix=redis_prefix).record_end(0, 4, [0, 1], StepCounts())
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


def test_a_write_that_read_the_run_before_another_process_cancelled_it_does_not_undo_the_cancel(
    redis_prefix: str, redis_client: redis.Redis
) -> None:
    """The race between two orchestrators: A's progress write read the run RUNNING, B's Cancel wrote
    CANCELLED (and answered so), then A's write put RUNNING back. The write is now a compare-and-set: A reads
    the run again, finds it over, and gets RunEnded."""
    seen: list[int] = []

    def progress_after_a_cancel_elsewhere(run: Run) -> None:
        seen.append(run.state)
        if len(seen) == 1:  # between A's read and A's write: B's Cancel, through another client
            cancelled = Run()
            cancelled.CopyFrom(run)
            cancelled.state = CANCELLED
            redis_client.set(f"{redis_prefix}run:r1:record", cancelled.SerializeToString())
        run.progress.groups_produced += 2

    async def scenario() -> Run:
        async with runs_core(redis_prefix) as a:
            await a.store.create(Run(id="r1", state=RUNNING))
            with pytest.raises(RunEnded, match="CANCELLED"):
                await a.update("r1", progress_after_a_cancel_elsewhere)
            return await a.get("r1")

    after = asyncio.run(scenario())
    assert seen == [RUNNING], "read again, the run was over: the progress was not applied to it"
    assert after.state == CANCELLED and after.progress.groups_produced == 0


def test_a_final_state_is_never_written_over(redis_prefix: str) -> None:
    """Even a write meant for a run that ended (the trainer's final progress) cannot give it another state."""

    def back_to_running(run: Run) -> None:
        run.state = RUNNING
        run.progress.step = 7

    async def scenario() -> Run:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="r1", state=FAILED, error="boom"))
            with pytest.raises(RunEnded, match="FAILED"):
                await core.update("r1", back_to_running, after_end=True)
            with pytest.raises(RunEnded):
                await core.update("r1", lambda run: setattr(run, "state", CANCELLED), after_end=True)
            await core.update("r1", lambda run: setattr(run.progress, "step", 7), after_end=True)
            return await core.get("r1")

    after = asyncio.run(scenario())
    assert (after.state, after.error, after.progress.step) == (FAILED, "boom", 7)


def test_a_cancelled_run_keeps_no_stall_report(redis_prefix: str) -> None:
    async def scenario() -> Run:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="r1", state=RUNNING, stalled="no progress for 600 s at step 2 of 9: ..."))
            return await core.cancel("r1")

    assert asyncio.run(scenario()).stalled == ""


def test_a_write_waiting_out_redis_holds_up_no_other_runs_write_nor_a_cancel(redis_prefix: str) -> None:
    """Before, one lock spanned every run of the orchestrator: while Redis was down each write held it for the
    client's 30 s of retries, so the k-th Cancel answered after k x 30 s, and every run's progress waited too."""

    async def scenario() -> tuple[Run, Run, Run]:
        async with runs_core(redis_prefix) as core:
            for run_id in ("slow", "other"):
                await core.store.create(Run(id=run_id, state=RUNNING))
            redis_back = asyncio.Event()
            store_update = core.store.update
            waiting: list[str] = []

            async def update(run_id: str, *args: object, **kwargs: object) -> tuple[Run, Run]:
                if run_id == "slow" and not waiting:
                    waiting.append(run_id)
                    await redis_back.wait()  # as a write retrying against a Redis that is down
                return await store_update(run_id, *args, **kwargs)  # type: ignore[arg-type]

            core.store.update = update  # type: ignore[method-assign]
            held = asyncio.create_task(core.update("slow", lambda run: setattr(run.progress, "step", 1)))
            queued = asyncio.create_task(core.update("slow", lambda run: setattr(run.progress, "step", 2)))
            await asyncio.sleep(0.05)
            async with asyncio.timeout(5):
                progressed = await core.update("other", lambda run: setattr(run.progress, "step", 3))
                cancelled = await core.cancel("other")
                # A caller's Cancel waits for no writer of the run loop's either, only for Redis.
                cancelled_slow = await core.cancel("slow")
            assert not held.done() and not queued.done()
            redis_back.set()
            async with asyncio.timeout(5):
                for late in await asyncio.gather(held, queued, return_exceptions=True):
                    assert isinstance(late, RunEnded), late  # the run was cancelled meanwhile
            return progressed, cancelled, cancelled_slow

    progressed, cancelled, cancelled_slow = asyncio.run(scenario())
    assert progressed.progress.step == 3 and cancelled.state == CANCELLED and cancelled_slow.state == CANCELLED


def test_the_queue_and_the_counts_read_the_runs_of_their_states_not_every_run(redis_prefix: str) -> None:
    """Records are kept for ever, and the run queue (every look) and the runs-by-state counts read every one of
    them: 150 ms a look with 5,000 runs. They now read the state sets, which each write keeps."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = RunStore(client, redis_prefix)
        read: list[str] = []
        mget = client.mget

        async def counted_mget(keys: list[str]) -> list[bytes | str | None]:
            read.extend(keys)
            return await mget(keys)

        try:
            for i in range(300):
                await store.create(Run(id=f"r{i:03}", state=QUEUED))
            for i in range(297):
                await store.update(f"r{i:03}", lambda run: setattr(run, "state", CANCELLED), expire_data_after_s=60)
            await store.update("r298", lambda run: setattr(run, "state", RUNNING), expire_data_after_s=60)
            await store.update("r299", lambda run: setattr(run, "state", FAILED), expire_data_after_s=60)
            client.mget = counted_mget  # type: ignore[method-assign,assignment]
            queue = await store.all_in_order([RUNNING, QUEUED])
            assert [(run.id, run.state) for run in queue] == [("r297", QUEUED), ("r298", RUNNING)]
            assert len(read) == 2, read
            assert await store.count_by_state() == {CANCELLED: 297, QUEUED: 1, RUNNING: 1, FAILED: 1}
            assert len(read) == 2
            assert [run.id for run in (await store.page(FAILED))[0]] == ["r299"] and len(read) == 3
            assert len((await store.page(CANCELLED, page_size=1000))[0]) == 297
        finally:
            await client.aclose()

    asyncio.run(scenario())


def write_records_without_state_sets(client: redis.Redis, prefix: str, runs: list[Run]) -> None:
    """Stores `runs` as a release without the state sets did: the record and the creation index only."""
    for run in runs:
        number = client.incr(f"{prefix}runs:seq")
        client.set(f"{prefix}run:{run.id}:record", run.SerializeToString())
        client.zadd(f"{prefix}runs:index", {run.id: number})


def test_a_store_written_before_the_state_sets_has_them_built_once(
    redis_prefix: str, redis_client: redis.Redis
) -> None:
    states = [QUEUED, CANCELLED, RUNNING, RunState.RUN_STATE_SUCCEEDED, QUEUED, FAILED, CANCELLED]
    write_records_without_state_sets(
        redis_client, redis_prefix, [Run(id=f"old{i}", state=state) for i, state in enumerate(states)]
    )

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            store = RunStore(client, redis_prefix)
            queue = await store.all_in_order([RUNNING, QUEUED])
            assert [run.id for run in queue] == ["old0", "old2", "old4"]
            assert await store.count_by_state() == {
                QUEUED: 2,
                CANCELLED: 2,
                RUNNING: 1,
                RunState.RUN_STATE_SUCCEEDED: 1,
                FAILED: 1,
            }
            await store.create(Run(id="new", state=QUEUED))
            assert redis_client.exists(f"{redis_prefix}runs:state-sets")
            # Built once: a store that comes later keeps what the writes since made of them.
            redis_client.zadd(f"{redis_prefix}runs:state:QUEUED", {"not-rebuilt": 99})
            later = RunStore(client, redis_prefix)
            assert (await later.count_by_state())[QUEUED] == 4
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_state_sets_built_while_runs_are_created_and_changed_hold_every_run_in_its_state(
    redis_prefix: str, redis_client: redis.Redis
) -> None:
    """A build reads every record before it writes the sets; runs created or changed meanwhile make it start
    again rather than be written over with what it read."""
    write_records_without_state_sets(
        redis_client, redis_prefix, [Run(id=f"old{i:04}", state=QUEUED) for i in range(3000)]
    )

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        writer = RunStore(client, redis_prefix)
        building = asyncio.Event()

        async def write_meanwhile() -> None:
            await building.wait()
            for i in range(40):
                await writer.create(Run(id=f"new{i}", state=QUEUED))
                await writer.update(f"old{i:04}", lambda run: setattr(run, "state", CANCELLED), expire_data_after_s=60)
                await asyncio.sleep(0.002)

        try:
            store = RunStore(client, redis_prefix)
            writes = asyncio.create_task(write_meanwhile())
            building.set()
            await store.count_by_state()
            await writes
            everything, token = await store.page(page_size=1000)
            while token:
                page, token = await store.page(page_size=1000, page_token=token)
                everything += page
            truth: dict[RunState, int] = {}
            for run in everything:
                truth[run.state] = truth.get(run.state, 0) + 1
            assert await store.count_by_state() == truth == {QUEUED: 3000, CANCELLED: 40}
        finally:
            await client.aclose()

    asyncio.run(scenario())
