"""JSON over HTTP to the router and the reward hub, with retries only where a retry can help.

Connection errors, 5xx answers and 429 (a reward hub or router at its admission limit) are retried with
exponential backoff inside one overall deadline, waiting at least what a Retry-After header asks; any other
4xx answer is the caller's mistake and is raised at once. A timeout ends the call: the request may still be
running at the other end.
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


class Refused(InvalidInput):
    """A 4xx answer other than 429. InvalidInput to the caller of a peer that judges what it is sent; a caller that
    knows the peer answers a bad request otherwise (the reward hub: a spec's problems in /validate's 200, an item
    it cannot score as an ERROR result in /score's) reads `status` as the peer's own fault (a path it lacks, an auth
    proxy in front of it)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def request_json(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    deadline_s: float,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Any:
    """The decoded JSON answer of `method url`; raises Refused (4xx), Unavailable or DeadlineExceeded."""
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
            if response.status_code < 500 and response.status_code != 429:
                raise Refused(
                    f"{url} rejected the request (HTTP {response.status_code}): {response.text[:500]}",
                    response.status_code,
                )
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            backoff = max(backoff, _retry_after_s(response))
        logger.warning("%s %s failed (%s); retrying in %.1fs", method, url, last, backoff)
        await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
        backoff = min(backoff * 2, _MAX_BACKOFF_S)
    raise Unavailable(f"{method} {url} did not succeed within {deadline_s:.0f}s (last: {last})")


def _retry_after_s(response: httpx.Response) -> float:
    """The seconds a Retry-After header asks to wait (its delay form), at most _MAX_BACKOFF_S; 0 without one."""
    try:
        return min(max(0.0, float(response.headers.get("retry-after", 0))), _MAX_BACKOFF_S)
    except ValueError:  # the HTTP-date form, which neither the router nor the reward hub sends
        return 0.0
