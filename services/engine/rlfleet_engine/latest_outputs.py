"""The outputs a request's jobs delivered and its caller has not read yet: the latest of each job only.

A job's outputs are cumulative (SGLang's streamed chunks: each holds the whole output so far, its ids, text and
logprobs), so a later one holds everything an earlier one did. A caller that reads slower than the engine decodes
(a client reading a stream over a slow link) then reads the latest output of each job, as SGLang's tokenizer
manager hands a stream the last of its pending outputs, and a request holds one unread output per job instead of
every chunk since its caller last read: for a 4096-token stream with logprobs that would be millions of entries.
The output that finishes a job is its last, so it is never replaced.
"""

from __future__ import annotations

import asyncio
from typing import Any


class LatestOutputs:
    """Per request, on the event loop: `put_nowait` keeps the latest output of each job, `get` takes the one that
    arrived first."""

    def __init__(self) -> None:
        self._latest: dict[int, dict[str, Any]] = {}  # job index -> its latest unread output, in arrival order
        self._ready = asyncio.Event()

    def put_nowait(self, item: tuple[int, dict[str, Any]]) -> None:
        index, out = item
        self._latest.pop(index, None)  # the newer output goes last: its job was heard from last
        self._latest[index] = out
        self._ready.set()

    async def get(self) -> tuple[int, dict[str, Any]]:
        while not self._latest:
            self._ready.clear()
            await self._ready.wait()
        index = next(iter(self._latest))
        return index, self._latest.pop(index)
