"""Server-sent events that stay alive while nothing happens.

A watched run can be quiet for a long time (queued behind another run, or waiting on a slow step), and a
stream that sends nothing for minutes is what proxies, load balancers and clients' read timeouts close.
An SSE comment line (`: keep-alive`) every `every_s` seconds of silence keeps it open and lets a client
tell a quiet run from a lost orchestrator; clients ignore comment lines (the SSE specification).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

KEEPALIVE = ": keep-alive\n\n"


async def with_keepalive(events: AsyncIterator[str], every_s: float) -> AsyncIterator[str]:
    """The items of `events`, and KEEPALIVE after each `every_s` seconds without one. The pending read of
    `events` survives the timeout (it is awaited again, never cancelled), so no event is lost; the cost is
    one timer per open stream."""
    source = aiter(events)
    pending: asyncio.Future[str] = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(source))
    finally:
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await pending
