"""request_json: which answers are retried and which are raised at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from rlfleet.errors import InvalidInput, Unavailable
from rlfleet_rollout.http_retry import request_json


def _call(answers: list[httpx.Response], deadline_s: float = 5.0) -> tuple[object, int, float]:
    """Runs request_json against a transport answering `answers` in turn: (result or error, attempts, seconds)."""
    attempts = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        return answers[min(attempts, len(answers)) - 1]

    async def run() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            try:
                return await request_json(client, "POST", "http://hub/score", deadline_s=deadline_s, body={})
            except (InvalidInput, Unavailable) as exc:
                return exc

    started = time.monotonic()
    result = asyncio.run(run())
    return result, attempts, time.monotonic() - started


def test_a_busy_hub_429_is_retried_after_what_retry_after_asks() -> None:
    busy = httpx.Response(429, headers={"Retry-After": "1"}, json={"detail": "busy"})
    result, attempts, seconds = _call([busy, httpx.Response(200, json={"ok": True})])
    assert result == {"ok": True}
    assert attempts == 2
    assert seconds >= 0.9  # Retry-After, not the first backoff of 0.2 s


def test_other_4xx_answers_are_raised_at_once() -> None:
    result, attempts, _ = _call([httpx.Response(400, json={"detail": "terms[0].name: unknown"})])
    assert isinstance(result, InvalidInput) and "terms[0].name" in str(result)
    assert attempts == 1


def test_a_hub_busy_past_the_deadline_is_unavailable_naming_the_last_answer() -> None:
    busy = httpx.Response(429, headers={"Retry-After": "0"}, text="at its limit of 16384 pending jobs")
    result, attempts, seconds = _call([busy], deadline_s=1.0)
    assert isinstance(result, Unavailable) and "429" in str(result) and "16384" in str(result)
    assert attempts >= 2 and seconds < 3


@pytest.mark.parametrize("value", ["soon", "Wed, 21 Oct 2026 07:28:00 GMT"])
def test_a_retry_after_that_is_not_seconds_falls_back_to_the_backoff(value: str) -> None:
    busy = httpx.Response(429, headers={"Retry-After": value})
    result, attempts, seconds = _call([busy, httpx.Response(200, json=[])])
    assert result == [] and attempts == 2 and seconds < 0.9
