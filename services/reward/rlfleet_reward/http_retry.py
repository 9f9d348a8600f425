"""POST JSON with retries where a retry can help: connection errors, timeouts and 5xx, inside a deadline.

Backoff doubles from 0.2 s up to 5 s; a 4xx answer is the request's fault and is raised at once, as is
a redirect (not followed: the URL was checked, its target was not) and an answer past 1 MiB, which is
read no further. Every attempt's timeout, to the answer's last byte, is the smaller of its own limit and
the time left. Errors name the URL and the HTTP status but never quote the answer: they reach the
run's owner, who need not see what an operator's service says.

Every call on an event loop shares one client, so items to the same reward model or judge reuse its
connections (keep-alive) instead of opening, and for HTTPS handshaking, one per item; and one SSL
context: building one loads the CA bundle (about 0.1 s of CPU), which per item would stall the hub's
event loop for seconds on a batch of fast remote items. The hub closes the clients as it stops.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import time
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import httpx

from rlfleet.errors import DeadlineExceeded, InvalidInput, Unavailable

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_SECONDS = 0.2
_MAX_BACKOFF_SECONDS = 5.0
MAX_ANSWER_BYTES = 1 << 20
"""The most of an answer the hub reads; a larger one is an error (a 200 MiB answer held the hub's memory)."""


# No bound on connections: the hub's max_concurrent_io_calls bounds the calls in flight.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
# Content-Encodings the hub reads, and whether each is inflated (zlib reads gzip and deflate's zlib stream alike).
_INFLATED = {"identity": False, "": False, "gzip": True, "x-gzip": True, "deflate": True}
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        client = _clients[loop] = httpx.AsyncClient(verify=_ssl_context(), limits=_LIMITS)
    return client


async def close_clients() -> None:
    """Closes the shared client of the running event loop (its kept-alive connections)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def post_json(url: str, body: Any | Callable[[], Any], *, attempt_seconds: float, deadline_seconds: float) -> Any:
    """The decoded JSON answer; raises InvalidInput (4xx, a redirect, not JSON, past MAX_ANSWER_BYTES),
    DeadlineExceeded or Unavailable. Messages name the status, never quote the answer.

    `body` is the JSON to send, or a function that builds each attempt's: a retry under the request id of an
    attempt the server may still be running, or aborting, could be refused as a duplicate or aborted with it."""
    deadline = time.monotonic() + deadline_seconds
    backoff = _FIRST_BACKOFF_SECONDS
    last = "no attempt"
    client = _client()
    while (remaining := deadline - time.monotonic()) > 0:
        limit = min(attempt_seconds, remaining)
        try:
            # httpx's timeout bounds each read; this bounds the whole answer, however slowly it trickles in.
            async with asyncio.timeout(limit):
                sent = body() if callable(body) else body
                status, content = await _post(client, url, sent, limit)
        except httpx.TransportError as exc:  # connection refused or reset, timeouts
            last = f"{type(exc).__name__}: {exc}"
        except TimeoutError:
            last = f"TimeoutError: no whole answer within {limit:g} s"
        else:
            if 200 <= status < 300:
                try:
                    return json.loads(content)
                except ValueError:
                    raise InvalidInput(f"{url} answered with invalid JSON ({len(content)} bytes)") from None
            if status < 500:
                raise InvalidInput(f"{url} refused the request (HTTP {status})")
            last = f"HTTP {status}"
        pause = min(backoff, max(0.0, deadline - time.monotonic()))
        logger.warning("POST %s failed (%s); retrying in %.1f s", url, last, pause)
        await asyncio.sleep(pause)
        backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)
    if last.startswith(("ReadTimeout", "ConnectTimeout", "WriteTimeout", "PoolTimeout", "TimeoutError")):
        raise DeadlineExceeded(f"POST {url} did not answer within {deadline_seconds:g} s (last: {last})")
    raise Unavailable(f"POST {url} did not succeed within {deadline_seconds:g} s (last: {last})")


async def _post(client: httpx.AsyncClient, url: str, body: Any, timeout: float) -> tuple[int, bytes]:
    """The status and, for a 2xx, the answer's bytes (decompressed), read no further than MAX_ANSWER_BYTES.

    The hub asks for the answer uncompressed; one compressed anyway (gzip, deflate) is inflated here no further
    than the bound either: httpx would inflate each network read whole first, 64 KiB of gzip into up to 64 MiB."""
    headers = {"accept-encoding": "identity"}
    async with client.stream("POST", url, json=body, timeout=timeout, headers=headers) as response:
        if not 200 <= response.status_code < 300:
            return response.status_code, b""  # not read: no error quotes it
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in _INFLATED:
            raise InvalidInput(f"{url} answered in Content-Encoding {encoding!r}; the hub reads identity or gzip")
        inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32) if _INFLATED[encoding] else None
        declared = response.headers.get("content-length", "")
        chunks: list[bytes] = []
        size = int(declared) if declared.isdigit() and inflate is None else 0
        if size <= MAX_ANSWER_BYTES:
            size = 0
            try:
                async for raw in response.aiter_raw():
                    chunk = raw if inflate is None else inflate.decompress(raw, MAX_ANSWER_BYTES + 1 - size)
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        break
                    chunks.append(chunk)
                else:
                    rest = b"" if inflate is None else inflate.flush()
                    size += len(rest)
                    chunks.append(rest)
            except zlib.error as exc:
                raise InvalidInput(f"{url} answered with a body that is not {encoding} ({exc})") from None
        if size > MAX_ANSWER_BYTES:
            raise InvalidInput(f"{url} answered more than 1 MiB; the hub reads at most {MAX_ANSWER_BYTES} bytes")
        return response.status_code, b"".join(chunks)
