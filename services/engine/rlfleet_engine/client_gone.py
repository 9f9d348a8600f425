"""A whole (not streamed) answer the engine stops working on when its client goes away.

A stream stops at its next chunk once the client has gone (the response's write fails, which ends
the job's generator and aborts its jobs). A whole answer writes nothing until it is done, so without
this the engine would decode up to max_new_tokens for nobody, holding a batch row, as SGLang does not:
its tokenizer manager aborts a request whose client disconnected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client of a whole answer disconnected before it was ready; its jobs were aborted."""


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (which aborts its jobs) and
    ClientGone is raised."""
    answer = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
    if not answer.done() or answer.cancelled():
        await asyncio.gather(answer, return_exceptions=True)  # let the cancellation run its aborts
        raise ClientGone
    return answer.result()
