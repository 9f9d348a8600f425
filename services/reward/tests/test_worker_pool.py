from __future__ import annotations

import asyncio
import os
import sys
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import pytest
from reward_test_functions import TEST_FUNCTIONS

from rlfleet_reward.reward_function import RewardInput
from rlfleet_reward.worker import Job
from rlfleet_reward.worker_pool import JobStatus, WorkerPool

T = TypeVar("T")
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


def job(function: str, seconds: float = 0.0) -> Job:
    return Job(function, RewardInput(response="abc\ndef"), {"seconds": seconds})


def test_results_errors_and_bad_return_values() -> None:
    async def body(pool: WorkerPool) -> None:
        parts = await pool.run(job("length_parts"), timeout=5)
        assert parts.status is JobStatus.OK
        assert (parts.score, dict(parts.parts)) == (0.5, {"chars": 7.0, "lines": 2.0})
        failed = await pool.run(job("raise"), timeout=5)
        assert failed.status is JobStatus.ERROR
        assert failed.error == "RuntimeError: cannot score 'abc\\ndef'"
        wrong_type = await pool.run(job("not_a_number"), timeout=5)
        assert wrong_type.status is JobStatus.ERROR
        assert "is a str; expected a float" in wrong_type.error

    with_pool(body)


def test_a_hang_times_out_within_its_limit_and_the_worker_is_replaced() -> None:
    async def body(pool: WorkerPool) -> None:
        pids = {w.process.pid for w in pool._workers}
        started = time.monotonic()
        result = await pool.run(job("hang"), timeout=0.5)
        elapsed = time.monotonic() - started
        assert result.status is JobStatus.TIMEOUT
        assert result.error == "exceeded its 0.5 s time limit"
        assert 0.5 <= elapsed < 1.5
        # Both workers serve again, one of them new.
        ok = await asyncio.gather(*(pool.run(job("sleep", 0.05), timeout=5) for _ in range(4)))
        assert [r.status for r in ok] == [JobStatus.OK] * 4
        assert pool.live == 2
        assert {w.process.pid for w in pool._workers} != pids

    with_pool(body)


def test_a_worker_that_dies_is_an_error_and_is_replaced() -> None:
    async def body(pool: WorkerPool) -> None:
        result = await pool.run(job("exit"), timeout=5)
        assert result.status is JobStatus.ERROR
        assert "died (exit code 3)" in result.error
        assert (await pool.run(job("sleep", 0.0), timeout=5)).status is JobStatus.OK

    with_pool(body, size=1)


def test_at_most_size_jobs_run_at_once() -> None:
    async def body(pool: WorkerPool) -> float:
        started = time.monotonic()
        results = await asyncio.gather(*(pool.run(job("sleep", 0.3), timeout=5) for _ in range(4)))
        assert all(r.status is JobStatus.OK for r in results)
        assert pool.busy == 0
        return time.monotonic() - started

    elapsed = with_pool(body, size=2)
    assert 0.6 <= elapsed < 1.5


def test_close_ends_every_worker_even_a_hung_one() -> None:
    pids: list[int] = []

    async def body(pool: WorkerPool) -> None:
        pids.extend(w.process.pid for w in pool._workers if w.process.pid is not None)
        hung = asyncio.create_task(pool.run(job("hang"), timeout=60))
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
