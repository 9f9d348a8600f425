"""Admission under `max_pending_jobs`: a bounded wait for room, first come first served."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from rlfleet_reward.admission import Admission, Overloaded


@contextlib.asynccontextmanager
async def held(admission: Admission, jobs: int) -> AsyncIterator[None]:
    """`jobs` admitted (at once: the hub has room) for the duration of the block."""
    async with asyncio.timeout(1):
        admit = admission.admit(jobs)
        await admit.__aenter__()
    try:
        yield
    finally:
        await admit.__aexit__(None, None, None)


async def admitted_then_wait(
    admission: Admission, jobs: int, order: list[str], name: str, leave: asyncio.Event
) -> None:
    async with admission.admit(jobs):
        order.append(name)
        await asyncio.wait_for(leave.wait(), 10)


async def settle() -> None:
    """Lets every task that can run, run."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_newcomer_that_would_fit_waits_behind_an_earlier_request_that_does_not() -> None:
    async def main() -> list[str]:
        admission = Admission(8, wait_seconds=10)
        order: list[str] = []
        leave = {name: asyncio.Event() for name in ("small", "large", "later")}
        small = asyncio.create_task(admitted_then_wait(admission, 2, order, "small", leave["small"]))
        await settle()
        large = asyncio.create_task(admitted_then_wait(admission, 8, order, "large", leave["large"]))
        await settle()
        later = asyncio.create_task(admitted_then_wait(admission, 2, order, "later", leave["later"]))
        await settle()
        assert (order, admission.pending, admission.waiting) == (["small"], 2, 2)  # 2 + 2 fits, but large came first
        leave["small"].set()
        await settle()
        assert (order, admission.pending, admission.waiting) == (["small", "large"], 8, 1)
        leave["large"].set()
        await settle()
        assert (admission.pending, admission.waiting) == (2, 0)
        leave["later"].set()
        await asyncio.wait_for(asyncio.gather(small, large, later), 5)
        assert admission.pending == 0
        return order

    assert asyncio.run(main()) == ["small", "large", "later"]


def test_a_steady_stream_of_small_requests_does_not_keep_a_large_one_out() -> None:
    async def main() -> tuple[float, int]:
        admission = Admission(8, wait_seconds=5)
        stop = asyncio.Event()

        async def small_requests() -> int:
            # Each holds 2 jobs for 30 ms, a new one every 10 ms: the hub is never empty while they run.
            served = 0
            tasks: set[asyncio.Task[None]] = set()
            while not stop.is_set():
                task = asyncio.create_task(hold_for(2, 0.03))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.01)
                served += 1
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return served

        async def hold_for(jobs: int, seconds: float) -> None:
            async with admission.admit(jobs):
                await asyncio.sleep(seconds)

        stream = asyncio.create_task(small_requests())
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await hold_for(8, 0.01)
        waited = time.monotonic() - started
        stop.set()
        served = await stream
        assert admission.pending == 0
        return waited, served

    waited, served = asyncio.run(main())
    assert waited < 1.0  # the 30 ms of the small requests ahead of it, not the whole stream
    assert served > 10


def test_an_idle_hub_admits_a_request_larger_than_the_limit() -> None:
    async def main() -> int:
        admission = Admission(4, wait_seconds=0)
        async with asyncio.timeout(1), admission.admit(100):
            return admission.pending

    assert asyncio.run(main()) == 100


def test_a_request_not_admitted_within_the_wait_is_refused_naming_the_limit_and_the_wait() -> None:
    async def main() -> tuple[str, float, int, int]:
        admission = Admission(4, wait_seconds=0.2)
        async with held(admission, 2):
            started = time.monotonic()
            with pytest.raises(Overloaded) as refused:
                async with asyncio.timeout(5), admission.admit(3):
                    pass
            return str(refused.value), time.monotonic() - started, admission.pending, admission.waiting

    message, waited, pending, waiting = asyncio.run(main())
    assert message == (
        "the hub is scoring 2 jobs (items x terms) and this request adds 3, past its limit of 4 (max_pending_jobs); "
        "it waited 0.2 s for room (admission_wait_seconds); retry in 1 s or send fewer items"
    )
    assert 0.15 < waited < 2
    assert (pending, waiting) == (2, 0)


def test_with_no_wait_a_request_past_the_limit_is_refused_at_once() -> None:
    async def main() -> str:
        admission = Admission(4, wait_seconds=0)
        async with held(admission, 2):
            with pytest.raises(Overloaded) as refused:
                async with asyncio.timeout(1), admission.admit(3):
                    pass
        return str(refused.value)

    assert asyncio.run(main()).startswith(
        "the hub is scoring 2 jobs (items x terms) and this request adds 3, past its limit of 4 (max_pending_jobs)"
    )


def test_past_max_waiting_a_request_is_refused_at_once_even_one_that_would_fit() -> None:
    async def main() -> str:
        admission = Admission(4, wait_seconds=10, max_waiting=1)
        async with held(admission, 2):
            waiting = asyncio.create_task(admitted_then_wait(admission, 3, [], "waiting", asyncio.Event()))
            await settle()
            assert admission.waiting == 1
            with pytest.raises(Overloaded) as refused:
                async with asyncio.timeout(1), admission.admit(1):
                    pass
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        assert (admission.pending, admission.waiting) == (0, 0)
        return str(refused.value)

    assert asyncio.run(main()) == (
        "the hub is scoring 2 jobs (items x terms) and this request adds 1, within its limit of 4 (max_pending_jobs), "
        "but requests that came first wait for room; the queue of requests waiting for room is full "
        "(1, max_waiting_requests); retry in 1 s or send fewer items"
    )


def test_a_waiting_request_whose_client_leaves_lets_the_ones_behind_it_in() -> None:
    async def main() -> list[str]:
        admission = Admission(8, wait_seconds=10)
        order: list[str] = []
        leave = asyncio.Event()
        async with held(admission, 4):
            large = asyncio.create_task(admitted_then_wait(admission, 8, order, "large", leave))
            await settle()
            small = asyncio.create_task(admitted_then_wait(admission, 2, order, "small", leave))
            await settle()
            assert (order, admission.waiting) == ([], 2)
            large.cancel()
            await settle()
            assert (order, admission.pending, admission.waiting) == (["small"], 6, 0)
            leave.set()
            await asyncio.wait_for(small, 5)
            assert large.cancelled()
        assert admission.pending == 0
        return order

    assert asyncio.run(main()) == ["small"]


def test_a_request_admitted_just_as_its_client_leaves_gives_its_room_back() -> None:
    async def main() -> tuple[int, int]:
        admission = Admission(4, wait_seconds=10)
        admit = admission.admit(4)
        await admit.__aenter__()
        waiting = asyncio.create_task(admitted_then_wait(admission, 4, [], "waiting", asyncio.Event()))
        await settle()
        await admit.__aexit__(None, None, None)  # admits the waiting request, which has not run since
        assert admission.pending == 4
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return admission.pending, admission.waiting

    assert asyncio.run(main()) == (0, 0)
