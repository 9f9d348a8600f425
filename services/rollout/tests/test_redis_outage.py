"""A Redis restart is waited out: the clients every service makes (`connect_redis` and its asyncio
twin) retry a lost connection with backoff, and an outage longer than that neither ends the run
queue nor loses a run's final record (`until_redis_answers`). Uses a redis-server of its own on a
free port (AOF on), never the shared one."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.sample_stream import SampleStream, connect_redis, connect_redis_async
from rlfleet.v1.samples_pb2 import Sample, SampleGroup
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.redis_outage import until_redis_answers
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_queue import RunQueue

OUTAGE_S = 1.5


class PrivateRedis:
    """A redis-server on a free port with its AOF in `data_dir`, to kill and start again."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.data_dir = data_dir
        self.process: ServiceProcess | None = None

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server is not None, "these tests need redis-server (apt-get install redis-server)"
        argv = [server, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
                "--appendonly", "yes", "--save", ""]  # fmt: skip
        self.process = ServiceProcess("redis", argv, self.data_dir / "redis.log")
        deadline = time.monotonic() + 10
        probe = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        while True:
            try:
                probe.ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, f"redis-server did not answer: {self.process.log_tail()}"
                time.sleep(0.05)
        probe.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.stop(timeout=5)

    def restart_later(self, delay_s: float) -> threading.Thread:
        """Starts the server again after `delay_s`, in the background."""

        def restart() -> None:
            time.sleep(delay_s)
            self.start()

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        return thread


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    if server.process is not None:
        server.process.stop(timeout=5)


def _group(run_id: str, group_id: str) -> SampleGroup:
    sample = Sample(prompt_token_ids=[1], response_token_ids=[1], rollout_logprobs=[0.0], loss_mask=[1])
    return SampleGroup(run_id=run_id, group_id=group_id, samples=[sample])


def test_commands_during_a_restart_wait_for_redis_and_append_nothing_twice(private_redis: PrivateRedis) -> None:
    client = connect_redis(private_redis.url, timeout_s=2.0)
    stream = SampleStream(client, "r1")
    stream.ensure_consumer_group()
    assert stream.append(_group("r1", "r1/0/0")) is not None

    private_redis.kill()
    restart = private_redis.restart_later(OUTAGE_S)
    start = time.monotonic()
    # Sent while Redis is down: each is retried until it is back, none raises.
    assert stream.append(_group("r1", "r1/0/1")) is not None
    waited = time.monotonic() - start
    restart.join(timeout=15)
    assert stream.append(_group("r1", "r1/0/1")) is None, "a group already appended is not appended again"
    entries = stream.read("trainer", count=10, block_ms=100)
    assert [e.group.group_id for e in entries] == ["r1/0/0", "r1/0/1"], "the AOF kept the first group"
    assert waited >= OUTAGE_S * 0.5, f"the append did not wait for the restart ({waited:.1f}s)"
    client.close()


def test_async_client_waits_out_a_restart(private_redis: PrivateRedis) -> None:
    async def scenario() -> bytes | str | None:
        client = connect_redis_async(private_redis.url, timeout_s=2.0)
        try:
            await client.set("k", b"v")
            private_redis.kill()
            private_redis.restart_later(OUTAGE_S)
            return await client.get("k")
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == b"v"


def test_until_redis_answers_waits_with_backoff_and_counts_the_outage() -> None:
    metrics = RolloutMetrics()
    calls: list[float] = []

    async def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise redis.ConnectionError("Connection refused")
        return "done"

    assert asyncio.run(until_redis_answers(flaky, "test waiter", metrics, first_wait_s=0.05)) == "done"
    assert len(calls) == 3
    assert calls[2] - calls[1] > calls[1] - calls[0], "the wait grows"
    assert metrics.redis_outage_waits.labels(waiter="test waiter")._value.get() == 2


def test_until_redis_answers_raises_other_errors_at_once() -> None:
    async def broken() -> None:
        raise redis.ResponseError("WRONGTYPE")

    with pytest.raises(redis.ResponseError):
        asyncio.run(until_redis_answers(broken, "test waiter", RolloutMetrics(), first_wait_s=0.05))


def test_run_queue_outlives_redis_being_unreachable() -> None:
    """The queue's task keeps serving (before: it raised ConnectionError and the orchestrator exited)."""
    looked: list[float] = []

    async def all_in_order(states: Any) -> list[Any]:
        looked.append(time.monotonic())
        if len(looked) <= 2:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return []

    async def free_trainer() -> None:  # the start-up check of the trainer's run meets the outage first
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    core = SimpleNamespace(store=SimpleNamespace(all_in_order=all_in_order), notifier=RunNotifier())
    deps = SimpleNamespace(core=core, metrics=RolloutMetrics(), release=SimpleNamespace(free=free_trainer))

    async def scenario() -> None:
        queue = RunQueue(deps)  # type: ignore[arg-type]
        task = asyncio.create_task(queue.serve())
        deadline = time.monotonic() + 10
        while len(looked) < 3:
            assert not task.done(), f"the run queue ended: {task.exception()!r}"
            assert time.monotonic() < deadline, "the run queue did not look again once Redis answered"
            await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        await asyncio.wait({task})

    asyncio.run(scenario())
    assert deps.metrics.redis_outage_waits.labels(waiter="run queue")._value.get() == 2
