"""The pool's idle workers and the lanes waiting for one, served first come, first served.

`asyncio.Queue` is unfair to a lane that puts a worker back and asks again at once: its `get` takes the
worker it has just put, before the waiter that the put woke gets to run. So one large batch kept every
worker from its first chunk to its last while a one-item request behind it waited for all of it. Here a
worker put back goes straight to the lane that has waited longest; it is kept idle only when none waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

W = TypeVar("W")


class IdleWorkers(Generic[W]):
    """`watch(worker)` is called when a worker starts waiting here idle, `unwatch(worker)` when it stops."""

    def __init__(self, watch: Callable[[W], None], unwatch: Callable[[W], None]) -> None:
        self._watch = watch
        self._unwatch = unwatch
        self._idle: deque[W] = deque()
        self._waiters: deque[asyncio.Future[W]] = deque()
        self._closed: Exception | None = None

    def put(self, worker: W) -> None:
        """Hands `worker` to the lane that has waited longest, or keeps it idle when none waits. After `close`
        it is dropped: the pool is stopping it."""
        if self._closed is not None:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # done: its lane was cancelled while it waited
                waiter.set_result(worker)
                return
        self._idle.append(worker)
        self._watch(worker)

    async def get(self) -> W:
        """An idle worker, or the next one put back once the lanes that asked earlier have theirs."""
        if self._closed is not None:
            raise self._closed
        if self._idle:
            worker = self._idle.popleft()
            self._unwatch(worker)
            return worker
        waiter: asyncio.Future[W] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.put(waiter.result())  # handed over just as the lane was cancelled: pass it on
            raise

    def discard(self, worker: W) -> None:
        """Forgets an idle worker (it died): no lane gets it."""
        if worker in self._idle:
            self._idle.remove(worker)
            self._unwatch(worker)

    def fail_waiters(self, error: Exception) -> None:
        """Fails every lane waiting now with `error`; later ones wait as before."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def close(self, error: Exception) -> list[W]:
        """Fails every waiting lane, and every later `get`, with `error`; returns the workers that were idle."""
        self._closed = error
        self.fail_waiters(error)
        idle = list(self._idle)
        self._idle.clear()
        for worker in idle:
            self._unwatch(worker)
        return idle
