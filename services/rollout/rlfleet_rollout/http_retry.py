"""JSON over HTTP to the router and the reward hub, with retries only where a retry can help.

Connection errors, timeouts and 5xx answers are retried with exponential backoff inside one
overall deadline; a 4xx answer is the caller's mistake and is raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from rlfleet.errors import DeadlineExceeded, InvalidInput, Unavailable

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0


async def request_json(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    deadline_s: float,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Any:
    """The decoded JSON answer of `method url`; raises InvalidInput (4xx), Unavailable or DeadlineExceeded."""
    deadline = time.monotonic() + deadline_s
    backoff = _FIRST_BACKOFF_S
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            response = await client.request(method, url, json=body, headers=headers, timeout=remaining)
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded(f"{method} {url} took longer than {deadline_s:.0f}s") from exc
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError as exc:
                    raise Unavailable(f"{method} {url} answered with invalid JSON: {exc}") from exc
            if response.status_code < 500:
                raise InvalidInput(f"{url} rejected the request (HTTP {response.status_code}): {response.text[:500]}")
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        logger.warning("%s %s failed (%s); retrying in %.1fs", method, url, last, backoff)
        await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
        backoff = min(backoff * 2, _MAX_BACKOFF_S)
    raise Unavailable(f"{method} {url} did not succeed within {deadline_s:.0f}s (last: {last})")
