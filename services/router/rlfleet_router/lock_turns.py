"""Waiting for a turn at an asyncio lock with a bound: in arrival order, until a deadline or until the caller leaves.

A fleet weight update that waits behind another one must either start while its caller still waits for
the answer, or never: applied later, it would land after the trainer gave up on it, perhaps after a
newer version. Cancelling and retrying `Lock.acquire` on a timer would lose the waiter's place in the
queue; here the acquire keeps its place while the caller is checked beside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from rlfleet.errors import Unavailable

CHECK_SECS = 0.2
"""How often a waiter looks whether its caller left."""


class NoTurn(Unavailable):
    """The wait ended without the lock: its deadline passed or its caller left, and what waited was not done."""


@asynccontextmanager
async def turn(
    lock: asyncio.Lock,
    what: str,
    deadline_secs: float,
    caller_gone: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[None]:
    """Holds `lock` for the block; raises NoTurn naming `what`, without ever taking the lock, once
    `deadline_secs` pass or `caller_gone()` is true before its turn comes."""
    deadline = time.monotonic() + deadline_secs
    acquire = asyncio.ensure_future(lock.acquire())
    try:
        while True:
            await asyncio.wait({acquire}, timeout=CHECK_SECS)
            if acquire.done():
                break
            if caller_gone is not None and await caller_gone():
                raise NoTurn(f"{what}: its caller left while it waited for the one before it; not applied")
            if time.monotonic() >= deadline:
                raise NoTurn(f"{what} waited {deadline_secs:g}s for the one before it to end; not applied, retry")
    except BaseException:
        acquire.cancel()
        if acquire.done() and not acquire.cancelled():
            lock.release()  # granted just as this gave up: hand it on
        raise
    try:
        yield
    finally:
        lock.release()
