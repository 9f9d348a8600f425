"""The feeds of watched runs alone, over a record held in memory: the watchers of a run share one reader, which
reads once per change published, and a reader's failure, expected or not, ends every watch of the run."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.errors import Internal, NotFound
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.run_events import RunFeeds, RunNotifier, is_terminal

WATCHERS = 50


class Records:
    """One run's record in memory, and how often it was read."""

    def __init__(self) -> None:
        self.run = Run(id="run-a", state=RunState.RUN_STATE_RUNNING)
        self.reads = 0
        self.fault: Exception | None = None

    async def read(self, run_id: str) -> Run:
        self.reads += 1
        await asyncio.sleep(0)  # a read takes a turn of the loop, as one from Redis does
        if self.fault is not None:
            raise self.fault
        return Run.FromString(self.run.SerializeToString())


async def _watch(feeds: RunFeeds, seen: list[Run]) -> None:
    with feeds.watching("run-a") as feed:
        shown: Run | None = None
        while shown is None or not is_terminal(shown.state):
            shown = await feed.after(shown)
            seen.append(shown)


def test_the_watchers_of_a_run_share_one_read_per_change() -> None:
    async def scenario() -> tuple[list[list[Run]], int, int]:
        records, notifier = Records(), RunNotifier()
        feeds = RunFeeds(notifier, records.read, poll_interval_s=60)  # no poll in this test: changes alone
        seen: list[list[Run]] = [[] for _ in range(WATCHERS)]
        watchers = [asyncio.create_task(_watch(feeds, runs)) for runs in seen]
        while not all(seen):
            await asyncio.sleep(0.01)
        for step in range(1, 6):
            records.run.progress.step = step
            notifier.publish(records.run)
            while not all(runs[-1].progress.step == step for runs in seen):
                await asyncio.sleep(0.01)
        records.run.state = RunState.RUN_STATE_SUCCEEDED
        notifier.publish(records.run)
        await asyncio.wait_for(asyncio.gather(*watchers), 5)
        return seen, records.reads, len(feeds._feeds)

    seen, reads, left = asyncio.run(scenario())
    assert reads == 1 + 5 + 1  # the first read, then one per change: not one per watcher
    assert all([run.progress.step for run in runs] == [0, 1, 2, 3, 4, 5, 5] for runs in seen)
    assert all(runs[-1].state == RunState.RUN_STATE_SUCCEEDED for runs in seen)
    assert left == 0


@pytest.mark.parametrize(
    ("fault", "raised"),
    [
        (NotFound("run 'run-a' not found"), NotFound("run 'run-a' not found")),
        (ValueError("a bug"), Internal("the watch of run run-a failed; the orchestrator's log says why")),
    ],
)
def test_a_readers_failure_ends_every_watch_of_the_run(fault: Exception, raised: Exception) -> None:
    """An error of ours (NotFound: the record was deleted) reaches each watcher as it is, any other as Internal
    (logged once, by the reader); each watcher raises its own copy."""

    async def scenario() -> list[BaseException | None]:
        records, notifier = Records(), RunNotifier()
        feeds = RunFeeds(notifier, records.read, poll_interval_s=60)
        seen: list[list[Run]] = [[] for _ in range(3)]
        watchers = [asyncio.create_task(_watch(feeds, runs)) for runs in seen]
        while not all(seen):
            await asyncio.sleep(0.01)
        records.fault = fault
        notifier.publish(records.run)
        done, _ = await asyncio.wait(watchers, timeout=5)
        return [w.exception() for w in done]

    errors = asyncio.run(scenario())
    assert len(errors) == 3 and len({id(e) for e in errors}) == 3
    assert all(type(e) is type(raised) and str(e) == str(raised) for e in errors)


def test_a_watcher_that_joins_right_after_a_change_first_sees_it() -> None:
    """The run held for the watchers may predate a change written here a moment ago, before the reader has read it
    again: a watch started then (a Cancel answered, then a watch of the run) first shows the change, not the run
    before it, as a watch that read the record itself did."""

    async def scenario() -> tuple[list[Run], list[Run]]:
        records, notifier = Records(), RunNotifier()
        feeds = RunFeeds(notifier, records.read, poll_interval_s=60)
        early: list[Run] = []
        first = asyncio.create_task(_watch(feeds, early))
        while not early:
            await asyncio.sleep(0.01)
        records.run.state = RunState.RUN_STATE_CANCELLED
        notifier.publish(records.run)
        late: list[Run] = []  # joins before the reader has run again
        await asyncio.wait_for(asyncio.gather(first, _watch(feeds, late)), 5)
        return early, late

    early, late = asyncio.run(scenario())
    assert [run.state for run in early] == [RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_CANCELLED]
    assert [run.state for run in late] == [RunState.RUN_STATE_CANCELLED]
