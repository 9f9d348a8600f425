"""Cancelling a task so that it really ends, even when a library drops one cancellation (Python 3.11's
asyncio.wait_for, under redis-py's asyncio client), and a clean-up that a shutdown's repeated cancellations do
not cut short (releasing a run's lease), and a batch of tasks whose first failure ends the others before it is
raised. That a shutdown mid-step leaves the run RUNNING is test_data_runs.py's
restart test."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from rollout_test_support import REDIS_URL

from rlfleet.sample_stream import connect_redis_async
from rlfleet_rollout.concurrency import RECANCEL_EVERY_S, cancel_and_wait, finish, gather_cancelling


async def shrugs_off_one_cancel(ended: list[str]) -> None:
    """A task that loses its first cancellation, as one inside asyncio.wait_for can."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass
    try:
        await asyncio.sleep(30)
    finally:
        ended.append("ended")


def test_a_task_that_loses_a_cancellation_is_cancelled_again() -> None:
    async def main() -> tuple[bool, float, list[str]]:
        ended: list[str] = []
        task = asyncio.create_task(shrugs_off_one_cancel(ended))
        await asyncio.sleep(0)
        started = time.monotonic()
        done = await cancel_and_wait(task)
        return done and task.cancelled(), time.monotonic() - started, ended

    cancelled, took, ended = asyncio.run(main())
    assert cancelled and ended == ["ended"]
    assert RECANCEL_EVERY_S * 0.9 < took < RECANCEL_EVERY_S * 3


def test_the_wait_is_bounded() -> None:
    stubborn = [True]

    async def shrugs_off_every_cancel() -> None:
        while stubborn[0]:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass

    async def main() -> tuple[bool, float, bool]:
        task = asyncio.create_task(shrugs_off_every_cancel())
        await asyncio.sleep(0)
        started = time.monotonic()
        done = await cancel_and_wait(task, within_s=1.2)
        took = time.monotonic() - started
        stubborn[0] = False
        return done, took, await cancel_and_wait(task, within_s=5)

    done, took, ended_once_it_yields = asyncio.run(main())
    assert not done and 1.1 < took < 2.5
    assert ended_once_it_yields


def test_a_cancelled_caller_still_waits_for_the_task_then_raises() -> None:
    async def main() -> tuple[list[str], bool]:
        ended: list[str] = []
        task = asyncio.create_task(shrugs_off_one_cancel(ended))
        await asyncio.sleep(0)
        caller = asyncio.create_task(cancel_and_wait(task))
        await asyncio.sleep(0.1)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        return ended, task.done()

    ended, done = asyncio.run(main())
    assert done and ended == ["ended"]


def test_a_clean_up_runs_to_its_end_through_repeated_cancellations_and_within_its_bound() -> None:
    async def clean_up(seconds: float, done: list[str]) -> str:
        await asyncio.sleep(seconds)
        done.append("released")
        return "released"

    async def main() -> tuple[list[str], bool, str]:
        done: list[str] = []
        caller = asyncio.create_task(finish(clean_up(3 * RECANCEL_EVERY_S, done), within_s=10))
        await asyncio.sleep(0)
        ended = await cancel_and_wait(caller, within_s=10)  # cancels it again every RECANCEL_EVERY_S
        result = await finish(clean_up(0.01, []), within_s=1)
        with pytest.raises(TimeoutError):
            await finish(clean_up(30, []), within_s=0.2)
        return done, ended and caller.cancelled(), result

    done, cancelled_after, result = asyncio.run(main())
    assert done == ["released"], "the clean-up was cut short"
    assert cancelled_after and result == "released"


async def fails_soon() -> None:
    await asyncio.sleep(0.05)
    raise RuntimeError("generation failed")


def test_a_failure_in_a_batch_is_raised_once_the_others_have_cleaned_up() -> None:
    """The others were cancelled but not awaited: the failure reached the caller while their clean-up (a multi-turn
    episode's trajectory deleted at the router) had yet to run, to run during the next step, or never."""

    async def releases_when_cancelled(released: list[str]) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.1)  # a DELETE at the router
            released.append("released")

    async def main() -> list[str]:
        released: list[str] = []
        with pytest.raises(RuntimeError, match="generation failed"):
            await gather_cancelling(
                [fails_soon(), releases_when_cancelled(released), releases_when_cancelled(released)]
            )
        return released

    assert asyncio.run(main()) == ["released", "released"]


def test_a_task_of_a_batch_that_ignores_its_cancellation_holds_the_failure_up_no_longer_than_the_bound() -> None:
    stubborn = [True]

    async def ignores_cancellation() -> None:
        while stubborn[0]:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass

    async def main() -> float:
        started = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match="generation failed"):
                await gather_cancelling([fails_soon(), ignores_cancellation()], stop_within_s=1.0)
            return time.monotonic() - started
        finally:
            stubborn[0] = False  # lets it end with the loop

    assert 1.0 < asyncio.run(main()) < 2.5


def test_a_task_cancelled_during_redis_commands_ends(redis_prefix: str) -> None:
    """redis-py sends each command through asyncio.wait_for, which on Python 3.11 can drop a cancellation that
    arrives as the send completes; cancelled at random points of a command loop, every task still ends."""

    async def main() -> tuple[int, int]:
        client = connect_redis_async(REDIS_URL)
        key = f"{redis_prefix}probe"
        await client.set(key, b"x" * 200)

        async def commands() -> None:
            while True:
                await client.get(key)
                await asyncio.sleep(0)

        rng, outlived_one_cancel, ended = random.Random(0), 0, 0
        try:
            for _ in range(12):
                task = asyncio.create_task(commands())
                await asyncio.sleep(rng.uniform(0, 0.002))
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=0.2)
                outlived_one_cancel += not done
                ended += await cancel_and_wait(task, within_s=10)
        finally:
            await client.delete(key)
            await client.aclose()
        return outlived_one_cancel, ended

    outlived, ended = asyncio.run(main())
    assert ended == 12
    print(f"{outlived} of 12 tasks outlived their first cancellation")
