"""A whole (not streamed) answer a service stops working on when its client goes away.

A stream stops at its next chunk once the client has gone (the response's write fails). A whole answer
writes nothing until it is done, so without this the work would run on for nobody: the engine would
decode up to max_new_tokens holding a batch row (SGLang's tokenizer manager aborts a request whose client
disconnected), the reward hub would keep its workers scoring a batch (gRPC cancels a call whose client
leaves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client of a whole answer disconnected before it was ready; the work for it was cancelled."""


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (its cleanup runs before this
    returns: an engine's aborts, the reward hub's workers given back) and ClientGone is raised."""
    answer = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
    if not answer.done() or answer.cancelled():
        await asyncio.gather(answer, return_exceptions=True)  # let the cancellation run its cleanup
        raise ClientGone
    return answer.result()
