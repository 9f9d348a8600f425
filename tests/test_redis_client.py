"""The services' Redis clients (`connect_redis`, `connect_redis_async`) bound a command's retries by time."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from rlfleet import sample_stream
from rlfleet.sample_stream import connect_redis, connect_redis_async


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A server that accepts connections and never answers (a hung Redis, a black-holed address behind a proxy)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join(5)
        for connection in held:
            connection.close()
        listener.close()


def test_a_command_to_a_redis_that_never_answers_ends_within_the_budget(
    silent_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attempt waits out its socket timeout, and counting retries alone let a command run 18 of them: three and
    a half minutes with the services' 30 s budget and 10 s timeouts, while the orchestrator reported Redis
    unreachable for longer than 30 s. Here: a 2 s budget, 1 s timeouts (before: 4 attempts and 1.4 s of backoff)."""
    monkeypatch.setattr(sample_stream, "REDIS_RETRY_BUDGET_S", 2.0)
    client = connect_redis(silent_redis, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.get("x")
    assert time.monotonic() - started < 3.5
    client.close()

    async def asynchronous() -> float:
        aclient = connect_redis_async(silent_redis, timeout_s=1.0)
        began = time.monotonic()
        try:
            with pytest.raises(redis.TimeoutError):
                await aclient.get("x")
            return time.monotonic() - began
        finally:
            await aclient.aclose()

    assert asyncio.run(asynchronous()) < 3.5


def test_a_command_that_fails_fast_is_retried_for_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis restarting refuses connections at once: the client keeps trying for the budget, not fewer seconds."""
    monkeypatch.setattr(sample_stream, "REDIS_RETRY_BUDGET_S", 1.5)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    client = connect_redis(f"redis://127.0.0.1:{port}/0", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("x")
    assert 1.0 < time.monotonic() - started < 2.5
    client.close()
