from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
from reward_test_functions import TEST_FUNCTIONS

from rlfleet.errors import Unavailable
from rlfleet_reward import worker_pool
from rlfleet_reward.reward_function import RewardInput
from rlfleet_reward.worker_pool import JobResult, JobStatus, WorkerPool

T = TypeVar("T")
OK, ERROR, TIMEOUT = JobStatus.OK, JobStatus.ERROR, JobStatus.TIMEOUT
FUNCTIONS = {name: function.fn for name, function in TEST_FUNCTIONS.items()}


def with_pool(body: Callable[[WorkerPool], Awaitable[T]], size: int = 2) -> T:
    async def main() -> T:
        pool = WorkerPool(FUNCTIONS, size)
        pool.start()
        try:
            return await body(pool)
        finally:
            await pool.close()

    return asyncio.run(main())


async def run_one(pool: WorkerPool, function: str, timeout: float, seconds: float = 0.0) -> JobResult:
    (result,) = await pool.run(function, {"seconds": seconds}, [RewardInput(response="abc\ndef")], timeout)
    return result


async def _until_busy(pool: WorkerPool, within_s: float = 5.0) -> None:
    """Until a worker has a chunk: the item in flight, the rest still queued."""
    deadline = time.monotonic() + within_s
    while pool.busy == 0:
        assert time.monotonic() < deadline, "no worker took a chunk"
        await asyncio.sleep(0.005)


def labelled(*labels: str) -> list[RewardInput]:
    return [RewardInput(label=label) for label in labels]


def test_results_errors_and_bad_return_values() -> None:
    async def body(pool: WorkerPool) -> None:
        parts = await run_one(pool, "length_parts", timeout=5)
        assert parts.status is JobStatus.OK
        assert (parts.score, dict(parts.parts)) == (0.5, {"chars": 7.0, "lines": 2.0})
        failed = await run_one(pool, "raise", timeout=5)
        assert failed.status is JobStatus.ERROR
        assert failed.error == "RuntimeError: cannot score 'abc\\ndef'"
        wrong_type = await run_one(pool, "not_a_number", timeout=5)
        assert wrong_type.status is JobStatus.ERROR
        assert "is a str; expected a float" in wrong_type.error

    with_pool(body)


def test_a_hang_times_out_within_its_limit_and_the_worker_is_replaced() -> None:
    async def body(pool: WorkerPool) -> None:
        pids = {w.process.pid for w in pool._workers}
        started = time.monotonic()
        result = await run_one(pool, "hang", timeout=0.5)
        elapsed = time.monotonic() - started
        assert result.status is JobStatus.TIMEOUT
        assert result.error == "exceeded its 0.5 s time limit"
        assert 0.5 <= elapsed < 1.5
        # Both workers serve again, one of them new.
        ok = await pool.run("sleep", {"seconds": 0.05}, labelled(*"abcd"), timeout=5)
        assert [r.status for r in ok] == [JobStatus.OK] * 4
        assert pool.live == 2
        assert {w.process.pid for w in pool._workers} != pids

    with_pool(body)


def test_a_worker_that_dies_is_an_error_and_is_replaced() -> None:
    async def body(pool: WorkerPool) -> None:
        result = await run_one(pool, "exit", timeout=5)
        assert result.status is JobStatus.ERROR
        assert "died (exit code 3)" in result.error
        assert (await run_one(pool, "sleep", timeout=5)).status is JobStatus.OK

    with_pool(body, size=1)


@pytest.mark.parametrize("noticed", [True, False], ids=["noticed", "not-yet-noticed"])
def test_workers_killed_while_idle_cost_no_item_and_are_replaced(noticed: bool) -> None:
    """The OOM killer or an operator may kill an idle worker: the items sent next must not pay for it."""

    async def body(pool: WorkerPool) -> None:
        killed = {w.process.pid for w in pool._workers}
        for worker in list(pool._workers):
            worker.process.kill()
            worker.process.join(5)  # dead, while the event loop has not run since
        if noticed:
            deadline = time.monotonic() + 10
            while (pool.live < 2 or killed & {w.process.pid for w in pool._workers}) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert pool.live == 2 and not killed & {w.process.pid for w in pool._workers}
        results = await pool.run("sleep", {"seconds": 0.0}, labelled(*"abcd"), timeout=5)
        assert [r.status for r in results] == [OK] * 4, [r.error for r in results]
        deadline = time.monotonic() + 10
        while pool.live < 2 and time.monotonic() < deadline:  # live once READY: the second may still be starting
            await asyncio.sleep(0.05)
        assert pool.live == 2

    with_pool(body)


def test_at_most_size_jobs_run_at_once() -> None:
    async def body(pool: WorkerPool) -> float:
        started = time.monotonic()
        results = await pool.run("sleep", {"seconds": 0.3}, labelled(*"abcd"), timeout=5)
        assert all(r.status is JobStatus.OK for r in results)
        assert pool.busy == 0
        return time.monotonic() - started

    elapsed = with_pool(body, size=2)
    assert 0.6 <= elapsed < 1.5


# With one worker the call's first chunk is "a" alone; once that is back quick, the next is half the items
# left: "slow", "b" and the misbehaving item. The worker sends the reply of "slow" as soon as it is done
# (0.15 s is past its flush interval) but holds that of "b", which dies with it: "b" alone is scored again,
# by the replacement worker.


@pytest.mark.parametrize(("culprit", "status", "error"), [("hang", TIMEOUT, "exceeded its 0.5 s time limit"),
                                                           ("exit", ERROR, "died (exit code 3)")])  # fmt: skip
def test_a_misbehaving_item_inside_a_chunk_fails_alone(
    tmp_path: Path, culprit: str, status: JobStatus, error: str
) -> None:
    log = tmp_path / "calls.log"

    async def body(pool: WorkerPool) -> None:
        await pool.run("record_label", {"log": str(tmp_path / "warm-up.log")}, labelled("quick"), timeout=5)
        started = time.monotonic()
        labels = ("a", "slow", "b", culprit, "c", "d", "e")
        results = await pool.run("record_label", {"log": str(log)}, labelled(*labels), timeout=0.5)
        assert time.monotonic() - started < 2.0
        assert [r.status for r in results] == [OK, OK, OK, status, OK, OK, OK]
        assert error in results[3].error
        assert pool.live == 1

    with_pool(body, size=1)
    assert sorted(log.read_text().split()) == sorted(["a", "slow", "b", "b", culprit, "c", "d", "e"])


def test_each_item_of_a_chunk_gets_its_whole_time_limit() -> None:
    async def body(pool: WorkerPool) -> float:
        started = time.monotonic()
        # A chunk of three items of 0.3 s runs for 0.9 s, well past one item's 0.5 s limit.
        results = await pool.run("sleep", {"seconds": 0.3}, labelled(*"abcdef"), timeout=0.5)
        assert [r.status for r in results] == [OK] * 6
        assert all(0.3 <= r.seconds < 0.5 for r in results)
        return time.monotonic() - started

    assert with_pool(body, size=1) >= 1.8


def test_a_batch_spreads_over_every_worker_and_ends_together() -> None:
    async def body(pool: WorkerPool) -> float:
        started = time.monotonic()
        results = await pool.run("sleep", {"seconds": 0.05}, labelled(*"abcdefghijklmnopqrstuvwx"), timeout=5)
        assert [r.status for r in results] == [OK] * 24
        return time.monotonic() - started

    # 0.6 s split evenly over two workers; 1.2 s on one.
    assert with_pool(body, size=2) < 0.95


def test_queued_items_are_counted_until_a_worker_takes_them() -> None:
    async def body(pool: WorkerPool) -> None:
        task = asyncio.create_task(pool.run("sleep", {"seconds": 0.3}, labelled(*"abcdef"), timeout=5))
        await _until_busy(pool)  # not a fixed sleep: on a loaded machine it could outlast the 0.3 s item
        assert (pool.busy, pool.waiting) == (1, 5)  # a function not seen yet goes one item at a time
        await task
        assert (pool.busy, pool.waiting) == (0, 0)

    with_pool(body, size=1)


def test_a_request_behind_a_large_batch_of_slow_items_waits_for_a_chunk_not_the_batch() -> None:
    """40 items of 0.2 s on two workers take 4 s; chunks of about 0.2 s handed out first come, first served
    let a one-item request in after about one item, rather than after the batch (or a 32-item chunk)."""

    async def body(pool: WorkerPool) -> tuple[float, bool]:
        batch = asyncio.create_task(pool.run("sleep", {"seconds": 0.2}, labelled(*"x" * 40), timeout=5))
        await asyncio.sleep(0.5)
        asked = time.monotonic()
        (quick,) = await pool.run("length_parts", {}, [RewardInput(response="a")], timeout=5)
        waited = time.monotonic() - asked
        assert quick.status is OK
        still_running = not batch.done()
        await batch
        return waited, still_running

    waited, batch_still_running = with_pool(body)
    assert batch_still_running
    assert waited < 0.6


def test_a_batch_of_slow_items_after_fast_ones_of_the_same_function_goes_out_in_small_chunks() -> None:
    """Sized by the fast items before, the slow batch went out in chunks of 4 items (1.6 s): a one-item request
    waited for a whole chunk. Each lane times the call's items with one item first, so it waits for one item."""

    async def body(pool: WorkerPool) -> float:
        await pool.run("sleep", {"seconds": 0.0}, labelled(*"x" * 100), timeout=5)
        batch = asyncio.create_task(pool.run("sleep", {"seconds": 0.4}, labelled(*"x" * 16), timeout=5))
        await asyncio.sleep(0.15)
        asked = time.monotonic()
        (quick,) = await pool.run("length_parts", {}, [RewardInput(response="a")], timeout=5)
        waited = time.monotonic() - asked
        assert quick.status is OK
        assert [r.status for r in await batch] == [OK] * 16
        return waited

    assert with_pool(body) < 0.7


def test_a_caller_that_goes_away_mid_chunk_gets_its_worker_replaced() -> None:
    async def body(pool: WorkerPool) -> None:
        pids = {w.process.pid for w in pool._workers}
        task = asyncio.create_task(pool.run("sleep", {"seconds": 0.3}, labelled(*"abcd"), timeout=5))
        await _until_busy(pool)  # mid-chunk: a fixed sleep could outlast the 0.3 s item on a loaded machine
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await run_one(pool, "sleep", timeout=5)).status is OK
        assert pool.live == 1 and {w.process.pid for w in pool._workers} != pids
        assert (pool.busy, pool.waiting) == (0, 0)

    with_pool(body, size=1)


def test_close_ends_every_worker_even_a_hung_one() -> None:
    pids: list[int] = []

    async def body(pool: WorkerPool) -> None:
        pids.extend(w.process.pid for w in pool._workers if w.process.pid is not None)
        hung = asyncio.create_task(run_one(pool, "hang", timeout=60))
        await asyncio.sleep(0.2)
        assert pool.busy == 1
        started = time.monotonic()
        await pool.close()
        assert time.monotonic() - started < 3
        hung.cancel()

    with_pool(body)
    for pid in pids:
        assert not _alive(pid), f"worker {pid} outlived the pool"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_that_cannot_start_fails_start_instead_of_every_job() -> None:
    # Importable here, not in a worker: the worker dies unpickling its functions, before READY.
    ghost = types.ModuleType("reward_ghost_module")

    def score(sample: RewardInput, params: Mapping[str, Any]) -> float:
        return 1.0

    score.__module__, score.__qualname__ = ghost.__name__, "score"
    ghost.score = score  # type: ignore[attr-defined]
    sys.modules[ghost.__name__] = ghost
    try:
        pool = WorkerPool({"ghost": score}, 1)
        with pytest.raises(RuntimeError, match="a reward worker failed to start"):
            pool.start()
        assert pool.live == 0
    finally:
        del sys.modules[ghost.__name__]


def test_when_no_worker_can_start_calls_fail_unavailable_and_the_pool_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importable here, not in a worker: a worker started with it dies unpickling its functions, before READY.
    ghost = types.ModuleType("reward_ghost_module_respawn")

    def score(sample: RewardInput, params: Mapping[str, Any]) -> float:
        return 1.0

    score.__module__, score.__qualname__ = ghost.__name__, "score"
    ghost.score = score  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, ghost.__name__, ghost)
    monkeypatch.setattr(worker_pool, "_RESPAWN_BACKOFF_SECONDS", 0.05)

    async def body(pool: WorkerPool) -> None:
        pool._functions = {**FUNCTIONS, "ghost": score}  # every worker started from now on fails to start
        (worker,) = pool._workers
        os.kill(worker.process.pid or 0, signal.SIGKILL)
        async with asyncio.timeout(10):
            while pool.live:  # the death noticed; a call sent before would be its item's ERROR
                await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(Unavailable) as refused:
            async with asyncio.timeout(20):  # without the limit on failed starts it would wait forever
                await run_one(pool, "sleep", timeout=5)
        assert time.monotonic() - started < 15
        assert "no reward worker is running: the last 3 attempts to start one failed" in str(refused.value)
        assert "a reward worker failed to start (exit code 1)" in str(refused.value)
        # Steadily down: a worker that is starting but has not said READY is not live.
        live: set[int] = set()
        for _ in range(40):
            live.add(pool.live)
            await asyncio.sleep(0.01)
        assert live == {0}
        with pytest.raises(Unavailable):  # a new call fails at once too
            await asyncio.wait_for(run_one(pool, "sleep", timeout=5), 1)
        pool._functions = dict(FUNCTIONS)  # workers can start again
        async with asyncio.timeout(20):
            while pool.down is not None or pool.live == 0:
                await asyncio.sleep(0.02)
        assert (await asyncio.wait_for(run_one(pool, "sleep", timeout=5), 10)).status is OK

    with_pool(body, size=1)
