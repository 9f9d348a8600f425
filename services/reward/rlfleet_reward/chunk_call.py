"""One chunk of items on one worker: send it, collect the replies, watch the running item's time limit.

Everything runs in event-loop callbacks, with no task or future per item: the pipe's reader takes each
batch of replies the worker sends, and a single timer sits at the running item's deadline. Only when
it fires does the hub look at the worker's `Progress`: if the item running then started less than the
limit ago, the timer moves to that item's deadline; otherwise that item is the culprit. An item's
limit counts from when the worker started it (or, before the first start, from when the chunk went).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from rlfleet_reward.worker import Chunk, Progress, Reply


class ChunkEnd(enum.Enum):
    DONE = "done"  # every item answered
    TIMEOUT = "timeout"  # the culprit ran past its limit; the worker must be killed
    DIED = "died"  # the pipe closed: the worker died while running the culprit
    LOST = "lost"  # the worker was gone before the chunk reached it: no item ran


@dataclass(frozen=True)
class ChunkOutcome:
    """`replies` answer the chunk's first items in order (none after LOST). After TIMEOUT or DIED,
    `culprit` is the item to blame, which ran from `started`; the items between the replies and the
    culprit were scored but their replies died with the worker, and they and the items after the
    culprit need scoring again."""

    end: ChunkEnd
    replies: list[Reply]
    culprit: int = -1
    started: float = 0.0


class ChunkCall:
    """Runs `chunk` on the worker at the other end of `conn`, whose progress is `progress`."""

    def __init__(self, conn: Connection, progress: Progress, chunk: Chunk, timeout: float) -> None:
        self._conn = conn
        self._progress = progress
        self._chunk = chunk
        self._timeout = timeout
        self._replies: list[Reply] = []
        self._sent = 0.0
        self._last_read = 0.0
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[ChunkEnd] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._blame = (-1, 0.0)  # (culprit, started), taken when the chunk ends without every reply

    async def run(self) -> ChunkOutcome:
        # The worker is idle in recv(), so it cannot write its progress while it is cleared.
        self._progress.clear()
        self._sent = self._last_read = time.monotonic()
        try:
            # A large chunk drains as fast as it is written.
            self._conn.send(self._chunk)
        except OSError:
            return ChunkOutcome(ChunkEnd.LOST, [])
        fd = self._conn.fileno()
        self._loop.add_reader(fd, self._read)
        self._arm(self._sent + self._timeout)
        try:
            end = await self._ended
        finally:
            self._loop.remove_reader(fd)
            if self._timer is not None:
                self._timer.cancel()
        return self._outcome(end)

    def _outcome(self, end: ChunkEnd) -> ChunkOutcome:
        if end is ChunkEnd.DONE:
            return ChunkOutcome(end, self._replies)
        culprit, started = self._blame
        return ChunkOutcome(end, self._replies, min(culprit, len(self._chunk.samples) - 1), started)

    def _running(self) -> tuple[int, float]:
        """The item the worker runs now and a time it started no later than (lenient, never early)."""
        running = self._progress.running()
        index, started = running if running is not None else (len(self._replies), self._sent)
        # Between two items, the next one started no earlier than the replies before it were read.
        return max(index, len(self._replies)), max(started, self._last_read)

    def _read(self) -> None:
        if self._ended.done():
            return
        try:
            replies = self._conn.recv()
        except (EOFError, OSError):
            self._end(ChunkEnd.DIED)
            return
        assert isinstance(replies, list), f"worker sent a {type(replies).__name__}"
        self._replies.extend(replies)
        self._last_read = time.monotonic()
        if len(self._replies) == len(self._chunk.samples):
            self._end(ChunkEnd.DONE)

    def _on_deadline(self) -> None:
        # Replies may be waiting unread when the timer fires in the same loop turn: read them first.
        try:
            while not self._ended.done() and self._conn.poll():
                self._read()
        except OSError:
            self._end(ChunkEnd.DIED)
        if self._ended.done():
            return
        _, started = self._running()
        deadline = started + self._timeout
        if time.monotonic() >= deadline:
            self._end(ChunkEnd.TIMEOUT)
        else:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        self._timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), self._on_deadline)

    def _end(self, end: ChunkEnd) -> None:
        if self._ended.done():
            return
        if end is not ChunkEnd.DONE:
            # Now, not later: a slow item that was not hung may still finish before the kill.
            self._blame = self._running()
        self._ended.set_result(end)
