"""In-process change notification for runs, and the one-line description of a change.

Watchers take a subscription before reading the record from Redis and wait on it afterwards, so a
change written between the read and the wait is never missed. Redis stays the source of truth:
a notification only says "read again". A run's event lives while someone watches the run (`watching`
counts them), so a watch of an unknown or ended run leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

from rlfleet.v1.runs_pb2 import Run, RunState

TERMINAL_STATES = frozenset({RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED, RunState.RUN_STATE_CANCELLED})

Listener = Callable[[Run], None]


def is_terminal(state: RunState) -> bool:
    return state in TERMINAL_STATES


def state_name(state: RunState) -> str:
    return RunState.Name(state).removeprefix("RUN_STATE_")


class RunNotifier:
    """Wakes watchers of a run, and calls listeners (the scheduler) with every written run."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._watchers: Counter[str] = Counter()
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @contextlib.contextmanager
    def watching(self, run_id: str) -> Iterator[None]:
        """Counts a watcher of `run_id` for as long as the block runs; the run's event goes with the last one."""
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
        event = self._events.pop(run.id, None)
        if event is not None:
            event.set()
        for listener in self._listeners:
            listener(run)

    def wake_all(self) -> None:
        """Sets every pending event (at shutdown, so watchers notice and end)."""
        events, self._events = self._events, {}
        for event in events.values():
            event.set()


def describe_change(before: Run | None, after: Run) -> str:
    """What changed from `before` to `after`, for humans reading a watch stream."""
    if before is None:
        return f"run {after.id} is {state_name(after.state)}"
    if before.state != after.state:
        text = f"run {after.id} is {state_name(after.state)}"
        return f"{text}: {after.error}" if after.error else text
    if before.stalled != after.stalled:
        return f"run {after.id}: {after.stalled}" if after.stalled else f"run {after.id} makes progress again"
    if len(after.evals) > len(before.evals):
        ev = after.evals[-1]
        return f"eval at step {ev.step}: accuracy {ev.accuracy:.3f} on {ev.size} held-out prompts"
    p = after.progress
    return (
        f"step {p.step}/{p.total_steps}, weight version {p.weight_version}, groups produced {p.groups_produced}, "
        f"trained {p.groups_trained}, mean reward {p.mean_reward:.3f}"
    )
