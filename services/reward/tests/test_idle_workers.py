from __future__ import annotations

import asyncio

import pytest

from rlfleet.errors import Unavailable
from rlfleet_reward.idle_workers import IdleWorkers


def watched() -> tuple[IdleWorkers[str], set[str]]:
    watching: set[str] = set()
    return IdleWorkers(watching.add, watching.discard), watching


def test_a_worker_put_back_goes_to_the_lane_that_waited_longest_not_the_one_that_put_it() -> None:
    async def main() -> list[str]:
        idle, watching = watched()
        idle.put("w1")
        assert watching == {"w1"}
        mine = await idle.get()
        assert watching == set()
        order: list[str] = []

        async def lane(name: str) -> None:
            await idle.get()
            order.append(name)

        waiting = asyncio.create_task(lane("waiting"))
        await asyncio.sleep(0)
        # The batch's lane finishes a chunk and asks again at once, as WorkerPool._lane does.
        idle.put(mine)
        again = asyncio.create_task(lane("same lane again"))
        await asyncio.sleep(0)
        idle.put("w2")
        await asyncio.gather(waiting, again)
        assert watching == set()
        return order

    assert asyncio.run(main()) == ["waiting", "same lane again"]


def test_a_worker_handed_to_a_cancelled_lane_goes_to_the_next() -> None:
    async def main() -> None:
        idle, watching = watched()
        cancelled = asyncio.create_task(idle.get())
        next_lane = asyncio.create_task(idle.get())
        await asyncio.sleep(0)
        idle.put("w")  # handed to the first lane ...
        cancelled.cancel()  # ... which leaves before it runs
        assert await next_lane == "w"
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert watching == set()

    asyncio.run(main())


def test_close_fails_waiting_and_later_lanes_and_returns_the_idle_workers() -> None:
    async def main() -> None:
        idle, watching = watched()
        waiting = asyncio.create_task(idle.get())
        await asyncio.sleep(0)
        assert idle.close(Unavailable("shut down")) == []
        with pytest.raises(Unavailable):
            await waiting
        with pytest.raises(Unavailable):
            await idle.get()
        idle.put("late")  # a chunk that ended as the pool closed
        assert watching == set()

        other, other_watching = watched()
        other.put("a")
        other.put("b")
        other.discard("a")
        assert other.close(Unavailable("shut down")) == ["b"] and other_watching == set()

    asyncio.run(main())
