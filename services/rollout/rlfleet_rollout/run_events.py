"""In-process change notification for runs, the one reader of a watched run's record, and the one-line description
of a change.

Writers in this process publish each run they write (`RunNotifier`). A run watched here has one reader however many
watch it (`RunFeed`): it reads the record at once, then again after each change published and at least every poll
interval (changes other processes write are seen then), and shows what it read to every watcher of the run, so
Redis sees one read per change, not one per watcher. Redis stays the source of truth: a notification only says
"read again". The reader subscribes before each read and waits afterwards, so a change written between the two is
never missed; changes written back to back, before its next read, reach the watchers as one, the run's latest state.
A watcher that comes while a change written here is still to be read waits for that read: its first event is as
current as a read of its own would have been.

A run that ends is not done with at once: its driver stops the trainer (after the trainer's step in progress) and
only then records what the trainer did up to the stop (run_loop.py, trainer_release.py). So the reader follows an
ended run until its driver has let go of it (no orchestrator holds its lease, run_lease.py; asked before each read,
since a driver lets go after its last write), for at most `end_wait_s`, and the watchers that showed the run before
its end get that end once, as the driver left it: with the trainer's final progress, not before it. A watcher that
comes once the run has ended gets it as it stands at once, as Get does.

A run's feed lives while someone watches the run (`RunFeeds.watching`), so a watch of an unknown or ended run
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

from rlfleet.errors import Internal, RlfleetError
from rlfleet.v1.runs_pb2 import Run, RunState

logger = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED, RunState.RUN_STATE_CANCELLED})

Listener = Callable[[Run], None]
RecordReader = Callable[[str], Awaitable[Run]]
"""Reads a run's record: the run, or an RlfleetError (NotFound, Unavailable)."""
DriverCheck = Callable[[str], Awaitable[bool]]
"""Whether an orchestrator drives a run now (holds its lease), or an RlfleetError (Unavailable)."""

END_WAIT_S = 30.0
"""Bound on holding back a run's end from its watchers until its driver has let go of it: the trainer stops after its
step in progress, and a driver that cannot reach it asks again for up to --step-timeout; past this the end goes out
as recorded (Get shows the trainer's final progress once it is in)."""


def is_terminal(state: RunState) -> bool:
    return state in TERMINAL_STATES


def state_name(state: RunState) -> str:
    return RunState.Name(state).removeprefix("RUN_STATE_")


class RunNotifier:
    """Wakes the readers of watched runs, and calls listeners (the scheduler) with every written run."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._watchers: Counter[str] = Counter()
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @contextlib.contextmanager
    def watching(self, run_id: str) -> Iterator[None]:
        """Counts a reader of `run_id` (a RunFeed's) for as long as the block runs; the run's event goes with the
        last one."""
        self._watchers[run_id] += 1
        try:
            yield
        finally:
            self._watchers[run_id] -= 1
            if self._watchers[run_id] <= 0:
                del self._watchers[run_id]
                self._events.pop(run_id, None)

    def subscribe(self, run_id: str) -> asyncio.Event:
        """The event the next change of `run_id` sets; ask for it inside `watching(run_id)`, which removes it."""
        return self._events.setdefault(run_id, asyncio.Event())

    def publish(self, run: Run) -> None:
        self.wake(run.id)
        for listener in self._listeners:
            listener(run)

    def wake(self, run_id: str) -> None:
        """Has the reader of `run_id` read it again, though its record did not change here (its driver let go of
        it); the listeners are not told."""
        event = self._events.pop(run_id, None)
        if event is not None:
            event.set()


class RunFeed:
    """One run's record as its reader last read it, for every watcher of the run in this process."""

    def __init__(
        self,
        run_id: str,
        read: RecordReader,
        notifier: RunNotifier,
        poll_interval_s: float,
        *,
        driven: DriverCheck | None = None,
        end_wait_s: float = END_WAIT_S,
    ) -> None:
        """`driven`: whether an orchestrator drives the run now; None: a run's end is final as soon as it is read."""
        self.watchers = 0
        self._run: Run | None = None
        self._final = False
        """The run held is the last the reader reads: it ended and its driver let go of it (or was waited for long
        enough)."""
        self._error: RlfleetError | None = None
        self._read_done = asyncio.Event()
        """Set by the reader's next read, or its failure, then replaced."""
        self._published_since = asyncio.Event()
        """Set once a change is published here after the read of the run held began."""
        self._reader = asyncio.create_task(
            self._follow(run_id, read, notifier, poll_interval_s, driven, end_wait_s), name=f"reader of run {run_id}"
        )

    @property
    def ended(self) -> bool:
        """The reader stopped: the run ended, the reading failed, or nobody watches any more."""
        return self._reader.done()

    async def after(self, shown: Run | None) -> Run:
        """The run as last read, once it is another than `shown` (what the watcher showed last); for a new watcher
        (`shown` None), once it was read after every change written here before the watcher came, as its own read
        would have been. A watcher that showed the run before its end gets the end once it is final (its driver let
        go of the run, or was waited for `end_wait_s`), or as last read if the reader stops first. The error that
        ended the reader once nothing newer is left."""
        while not self._ready_for(shown):
            if self._error is not None:
                # Each watcher raises a copy: one exception raised in many tasks would gather all their tracebacks.
                raise copy.copy(self._error) from self._error
            await self._read_done.wait()
        assert self._run is not None
        return self._run

    def _ready_for(self, shown: Run | None) -> bool:
        run = self._run
        # By identity: the reader keeps the run it has unless a read finds the record changed.
        if run is None or run is shown:
            return False
        if shown is None:
            return self._current()
        return not is_terminal(run.state) or self._final or self._error is not None or self.ended

    def fail(self, error: RlfleetError) -> None:
        """Stops the reader; each watcher gets `error` once it has shown the last run read (an end held back for the
        run's driver included)."""
        self._reader.cancel()
        self._end_with(error)

    def stop(self) -> None:
        """Stops the reader (its last watcher left)."""
        self._reader.cancel()

    async def _follow(
        self,
        run_id: str,
        read: RecordReader,
        notifier: RunNotifier,
        poll_interval_s: float,
        driven: DriverCheck | None,
        end_wait_s: float,
    ) -> None:
        with notifier.watching(run_id):
            try:
                end_by: float | None = None  # once the run ended: when (monotonic) its end goes out, final or not
                while True:
                    changed = notifier.subscribe(run_id)  # before the read: a change written during it is read next
                    # Before the read: a driver lets go of its run after its last write, which the read then holds.
                    driving = driven is not None and await driven(run_id)
                    run = await read(run_id)
                    if run != self._run:
                        self._run = run
                    now_s = time.monotonic()
                    if is_terminal(run.state) and end_by is None:
                        end_by = now_s + end_wait_s
                    waited_out = end_by is not None and now_s >= end_by
                    if driving and waited_out:
                        logger.info(
                            "run %s ended, and its driver has not let go of it within %.0fs: its watchers get its end "
                            "as recorded (Get shows the trainer's final progress once it is in)",
                            run_id,
                            end_wait_s,
                            extra={"run_id": run_id},
                        )
                    self._final = end_by is not None and (not driving or waited_out)
                    self._published_since = changed
                    self._wake()
                    if self._final:
                        return
                    wait_s = poll_interval_s if end_by is None else min(poll_interval_s, end_by - now_s)
                    with contextlib.suppress(TimeoutError):
                        # The bound picks up changes another process wrote. asyncio.timeout, not wait_for, which on
                        # Python 3.11 can lose a cancellation (concurrency.py).
                        async with asyncio.timeout(wait_s):
                            await changed.wait()
            except RlfleetError as exc:
                self._end_with(exc)
            except Exception:  # a fault of ours: the watchers must end, not wait on a reader that is gone
                logger.exception("reading run %s for its watchers failed", run_id, extra={"run_id": run_id})
                self._end_with(Internal(f"the watch of run {run_id} failed; the orchestrator's log says why"))

    def _current(self) -> bool:
        """The run held has every change published here so far, or is the last the reader reads."""
        return not self._published_since.is_set() or self.ended

    def _end_with(self, error: RlfleetError) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        read_done, self._read_done = self._read_done, asyncio.Event()
        read_done.set()


class RunFeeds:
    """The feed of each run watched in this process, from its first watcher to its last."""

    def __init__(
        self,
        notifier: RunNotifier,
        read: RecordReader,
        poll_interval_s: float,
        *,
        driven: DriverCheck | None = None,
        end_wait_s: float = END_WAIT_S,
    ) -> None:
        """`driven` and `end_wait_s`: as RunFeed's."""
        self._notifier = notifier
        self._read = read
        self._poll_interval_s = poll_interval_s
        self._driven = driven
        self.end_wait_s = end_wait_s
        """For the feeds made from now on."""
        self._feeds: dict[str, RunFeed] = {}

    @contextlib.contextmanager
    def watching(self, run_id: str) -> Iterator[RunFeed]:
        """The run's feed for as long as the block runs: a new one if none reads the run (the first watcher, or the
        last feed ended: the run did, or the reading failed); it stops with its last watcher."""
        feed = self._feeds.get(run_id)
        if feed is None or feed.ended:
            feed = self._feeds[run_id] = RunFeed(
                run_id,
                self._read,
                self._notifier,
                self._poll_interval_s,
                driven=self._driven,
                end_wait_s=self.end_wait_s,
            )
        feed.watchers += 1
        try:
            yield feed
        finally:
            feed.watchers -= 1
            if feed.watchers == 0:
                feed.stop()
                if self._feeds.get(run_id) is feed:
                    del self._feeds[run_id]

    def close(self, error: RlfleetError) -> None:
        """Ends every feed with `error` (at shutdown: every watch ends with it)."""
        feeds, self._feeds = self._feeds, {}
        for feed in feeds.values():
            feed.fail(error)


def describe_change(before: Run | None, after: Run) -> str:
    """What changed from `before` to `after`, for humans reading a watch stream."""
    if before is None or before.state != after.state:
        # A watch that comes once the run failed is told why, as one that saw it fail is.
        text = f"run {after.id} is {state_name(after.state)}"
        return f"{text}: {after.error}" if after.error else text
    if before.stalled != after.stalled:
        return f"run {after.id}: {after.stalled}" if after.stalled else f"run {after.id} makes progress again"
    if len(after.evals) > len(before.evals):
        ev = after.evals[-1]
        text = f"eval at step {ev.step}: accuracy {ev.accuracy:.3f} on {ev.size} held-out prompts"
        return f"{text} ({ev.prompts_too_long} more left out as too long)" if ev.prompts_too_long else text
    p = after.progress
    return (
        f"step {p.step}/{p.total_steps}, weight version {p.weight_version}, groups produced {p.groups_produced}, "
        f"trained {p.groups_trained}, mean reward {p.mean_reward:.3f}"
    )
