"""One deadline on a whole httpx exchange: the router's probes, controls, weight requests and Kubernetes calls.

httpx bounds each step of a request (connect, each write, each read), never the whole: an answer whose bytes
keep trickling in, each within the read bound, is waited for without end. A probe that never ends keeps its
engine from ever being judged (one probe per engine at a time): a hung engine that trickles stays in routing, or
out of it and never restarted. `DeadlineTransport` gives each exchange, its answer's last byte included, its
connect bound plus its read bound, and past it fails as httpx does when a read times out (`httpx.ReadTimeout`),
so callers handle it as they handle any timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx


class DeadlineTransport(httpx.AsyncBaseTransport):
    """Wraps `inner`, bounding each exchange whole by the request's timeout (`connect` + `read`; none if unset)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        bounds = request.extensions.get("timeout") or {}
        read = bounds.get("read")
        if read is None:
            return await self._inner.handle_async_request(request)
        secs = read + (bounds.get("connect") or 0.0)
        deadline = asyncio.get_running_loop().time() + secs
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._inner.handle_async_request(request)
        except TimeoutError:
            raise _timed_out(request, secs) from None
        assert isinstance(response.stream, httpx.AsyncByteStream), "an async transport's answer streams async"
        response.stream = _DeadlineStream(response.stream, deadline, secs, request)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _DeadlineStream(httpx.AsyncByteStream):
    """An answer's body, each piece due by the exchange's deadline."""

    def __init__(self, inner: httpx.AsyncByteStream, deadline: float, secs: float, request: httpx.Request) -> None:
        self._inner = inner
        self._deadline = deadline
        self._secs = secs
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pieces = aiter(self._inner)
        while True:
            try:
                async with asyncio.timeout_at(self._deadline):
                    piece = await anext(pieces)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _timed_out(self._request, self._secs) from None
            yield piece

    async def aclose(self) -> None:
        await self._inner.aclose()


def _timed_out(request: httpx.Request, secs: float) -> httpx.ReadTimeout:
    return httpx.ReadTimeout(f"no whole answer within {secs:g}s (connect and read bounds)", request=request)
