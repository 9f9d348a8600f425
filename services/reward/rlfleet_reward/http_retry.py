"""POST JSON with retries where a retry can help: connection errors, timeouts and 5xx, inside a deadline.

Backoff doubles from 0.2 s up to 5 s; a 4xx answer is the request's fault and is raised at once.
Every attempt's timeout is the smaller of its own limit and the time left.

Every call on an event loop shares one client, so items to the same reward model or judge reuse its
connections (keep-alive) instead of opening, and for HTTPS handshaking, one per item; and one SSL
context: building one loads the CA bundle (about 0.1 s of CPU), which per item would stall the hub's
event loop for seconds on a batch of fast remote items. The hub closes the clients as it stops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
import weakref
from typing import Any

import httpx

from rlfleet.errors import DeadlineExceeded, InvalidInput, Unavailable

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_SECONDS = 0.2
_MAX_BACKOFF_SECONDS = 5.0


# No bound on connections: the hub's max_concurrent_io_calls bounds the calls in flight.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
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


async def post_json(url: str, body: Any, *, attempt_seconds: float, deadline_seconds: float) -> Any:
    """The decoded JSON answer; raises InvalidInput (4xx or not JSON), DeadlineExceeded or Unavailable."""
    deadline = time.monotonic() + deadline_seconds
    backoff = _FIRST_BACKOFF_SECONDS
    last = "no attempt"
    client = _client()
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            response = await client.post(url, json=body, timeout=min(attempt_seconds, remaining))
        except httpx.TransportError as exc:  # connection refused or reset, timeouts
            last = f"{type(exc).__name__}: {exc}"
        else:
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError:
                    raise InvalidInput(f"{url} answered with invalid JSON: {response.text[:200]!r}") from None
            if response.status_code < 500:
                code = response.status_code
                raise InvalidInput(f"{url} refused the request (HTTP {code}): {response.text[:300]}")
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        pause = min(backoff, max(0.0, deadline - time.monotonic()))
        logger.warning("POST %s failed (%s); retrying in %.1f s", url, last, pause)
        await asyncio.sleep(pause)
        backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)
    if last.startswith(("ReadTimeout", "ConnectTimeout", "WriteTimeout", "PoolTimeout")):
        raise DeadlineExceeded(f"POST {url} did not answer within {deadline_seconds:g} s (last: {last})")
    raise Unavailable(f"POST {url} did not succeed within {deadline_seconds:g} s (last: {last})")
