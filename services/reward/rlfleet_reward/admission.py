"""The cap on scoring jobs the hub holds at once, across requests, and the short, fair wait for room under it.

A job is one (item, term) pair of a request being scored, waiting for a worker or running. Without a cap
the hub takes every request however far behind its workers are: twenty requests of 4096 items behind one
busy worker queued 65,472 jobs, minutes to hours of work for clients that would time out long before.

A request that would take the hub past `max_pending_jobs` waits for room, first come first served: requests
are admitted in the order they arrived, and a newcomer waits behind anyone already waiting even if it would
fit, so a steady stream of small requests cannot keep a large one out forever, nor a large one keep out the
small ones behind it for longer than its own run. An idle hub admits any request within `max_batch_size`,
whatever its terms. The wait is bounded twice: a request not admitted within `admission_wait_seconds`, or
one that finds `max_waiting_requests` already waiting, is refused (HTTP 429 with Retry-After, gRPC
RESOURCE_EXHAUSTED), so the client backs off or goes to another replica rather than queueing minutes of
work. A waiting request whose client leaves gives up its place, and those behind it that now fit go in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rlfleet.errors import ResourceExhausted

# The hub frees jobs continuously, so a short wait is as good a guess as any, and a refusal costs little.
RETRY_AFTER_SECONDS = 1


class Overloaded(ResourceExhausted):
    """The hub holds as many jobs as it may take; the same request may succeed after `RETRY_AFTER_SECONDS`."""

    http_status = 429
    kind = "overloaded"


@dataclass(eq=False)
class _Waiter:
    jobs: int
    admitted: asyncio.Future[None]


class Admission:
    """Holds the count of pending jobs and the queue of requests waiting for room, in arrival order."""

    def __init__(self, max_pending_jobs: int, wait_seconds: float = 5.0, max_waiting: int = 64) -> None:
        if max_pending_jobs < 1:
            raise ValueError(f"max_pending_jobs must be at least 1, got {max_pending_jobs}")
        if not wait_seconds >= 0:
            raise ValueError(f"admission_wait_seconds must be >= 0, got {wait_seconds}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting}")
        self.max_pending_jobs = max_pending_jobs
        self.wait_seconds = wait_seconds
        self.max_waiting = max_waiting
        self.pending = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def admit(self, jobs: int) -> AsyncIterator[None]:
        """Holds `jobs` for the duration of the block, once admitted; Overloaded when there is no room in time."""
        await self._enter(jobs)
        try:
            yield
        finally:
            self._leave(jobs)

    async def _enter(self, jobs: int) -> None:
        if not self._waiters and self._fits(jobs):
            self.pending += jobs
            return
        if self.wait_seconds == 0:
            raise self._refusal(jobs, "admission_wait_seconds is 0, so requests do not wait for room")
        if len(self._waiters) >= self.max_waiting:
            why = f"the queue of requests waiting for room is full ({self.max_waiting}, max_waiting_requests)"
            raise self._refusal(jobs, why)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(jobs, loop.create_future())
        self._waiters.append(waiter)
        # Expiry is decided here, on the loop, as admission is: a request is either admitted or refused, never
        # both, whichever comes first.
        expiry = loop.call_later(self.wait_seconds, self._expire, waiter)
        try:
            await waiter.admitted
        except asyncio.CancelledError:
            if waiter.admitted.done() and not waiter.admitted.cancelled() and waiter.admitted.exception() is None:
                self._leave(jobs)  # admitted just as its client left: give the room back
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self._admit_waiters()  # it may have held back smaller requests behind it that fit now
            raise
        finally:
            expiry.cancel()

    def _leave(self, jobs: int) -> None:
        self.pending -= jobs
        self._admit_waiters()

    def _fits(self, jobs: int) -> bool:
        return self.pending == 0 or self.pending + jobs <= self.max_pending_jobs

    def _admit_waiters(self) -> None:
        """Admits waiting requests in arrival order while the first one fits; the rest keep their places."""
        while self._waiters:
            first = self._waiters[0]
            if first.admitted.done():  # cancelled with its request, which leaves the queue as soon as it runs
                self._waiters.popleft()
                continue
            if not self._fits(first.jobs):
                return
            self._waiters.popleft()
            self.pending += first.jobs
            first.admitted.set_result(None)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter not in self._waiters:
            return
        self._waiters.remove(waiter)
        if not waiter.admitted.done():
            why = f"it waited {self.wait_seconds:g} s for room (admission_wait_seconds)"
            waiter.admitted.set_exception(self._refusal(waiter.jobs, why))
        self._admit_waiters()

    def _refusal(self, jobs: int, why: str) -> Overloaded:
        load = f"the hub is scoring {self.pending} jobs (items x terms) and this request adds {jobs}"
        if self.pending + jobs > self.max_pending_jobs:
            load += f", past its limit of {self.max_pending_jobs} (max_pending_jobs)"
        else:
            load += (
                f", within its limit of {self.max_pending_jobs} (max_pending_jobs), but requests that came first "
                "wait for room"
            )
        return Overloaded(f"{load}; {why}; retry in {RETRY_AFTER_SECONDS} s or send fewer items")
