"""A Redis restart is waited out: the clients every service makes (`connect_redis` and its asyncio
twin) retry a lost connection with backoff, and an outage longer than that neither ends the run
queue nor loses a run's final record (`until_redis_answers`), nor ends the tasks beside a run (the step
watchdog, the step reports) for the rest of it. Uses a redis-server of its own on a free port (AOF on),
never the shared one."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core

from rlfleet.errors import Unavailable
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.sample_stream import SampleStream, connect_redis, connect_redis_async
from rlfleet.v1.runs_pb2 import Run, RunProgress, RunSpec, RunState
from rlfleet.v1.samples_pb2 import Sample, SampleGroup
from rlfleet.v1.trainer_pb2 import StepReport
from rlfleet_rollout import run_loop
from rlfleet_rollout.metrics import REDIS_WAITERS, RolloutMetrics
from rlfleet_rollout.redis_outage import until_redis_answers
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_queue import RunQueue
from rlfleet_rollout.step_reports import StepReportFollower
from rlfleet_rollout.step_watchdog import watch_progress
from rlfleet_rollout.trainer_session import TrainerSession

OUTAGE_S = 1.5


class PrivateRedis:
    """A redis-server on a free port with its AOF in `data_dir`, to kill and start again. Every write reaches the
    AOF before Redis answers it (appendfsync always): with the default (everysec) a write may wait up to 2 s while
    an fsync runs, and one answered just before the kill was lost on a busy machine."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.data_dir = data_dir
        self.process: ServiceProcess | None = None

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server is not None, "these tests need redis-server (apt-get install redis-server)"
        argv = [server, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", ""]  # fmt: skip
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
        queue = RunQueue(deps, SimpleNamespace())  # type: ignore[arg-type]  # no run: no lease is asked for
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


REFUSED = "Error 111 connecting to 127.0.0.1:6379. Connection refused."


def test_a_run_failed_by_a_long_outage_is_recorded_failed_though_its_final_progress_is_not(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's case: the loop gave up on Redis after the client's retries, StopRun was answered, but writing the
    trainer's final progress met Redis away too; that error escaped before FAILED was written, so the run stayed
    RUNNING and was resumed. The FAILED record now comes first, waited for (until_redis_answers); the final progress
    is best effort."""

    async def drive(run: Run, session: TrainerSession, deps: run_loop.RunDeps) -> None:
        raise redis.ConnectionError(REFUSED)

    monkeypatch.setattr(run_loop, "_drive", drive)

    async def scenario() -> tuple[Run, StopOnlyTrainer]:
        async with runs_core(redis_prefix) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED))
            update, writes = core.update, []

            async def update_while_redis_comes_and_goes(
                run_id: str, mutate: Any, *, after_end: bool = False, by_caller: bool = False
            ) -> Run:
                writes.append(after_end)
                if len(writes) == 2 or after_end:  # the first try of the final record, and the final progress
                    raise redis.ConnectionError(REFUSED)
                return await update(run_id, mutate, after_end=after_end, by_caller=by_caller)

            monkeypatch.setattr(core, "update", update_while_redis_comes_and_goes)
            trainer = StopOnlyTrainer(core)
            await asyncio.wait_for(run_loop.execute_run("run-a", run_deps(core, trainer)), timeout=15)
            return await core.get("run-a"), trainer

    final, trainer = asyncio.run(scenario())
    assert final.state == RunState.RUN_STATE_FAILED
    assert final.error.startswith("Redis was unreachable for longer than 30s: ConnectionError")
    assert trainer.states_seen == ["FAILED"], "the trainer is stopped once, after FAILED is recorded"


class FlakyRecords:
    """One running run in memory whose reads and writes fail as an unreachable Redis does, `failures` times each."""

    def __init__(self, failures: int, write_error: Exception | None = None) -> None:
        self.write_error = write_error or redis.ConnectionError(REFUSED)
        spec = RunSpec()
        spec.rollout.groups_per_step = 2
        self.run = Run(id="run-1", spec=spec, state=RunState.RUN_STATE_RUNNING, progress=RunProgress(total_steps=9))
        self.failures = {"get": failures, "update": failures}
        self.errors: list[str] = []

    def _fail(self, what: str) -> None:
        if self.failures[what] > 0:
            self.failures[what] -= 1
            self.errors.append(what)
            # A read through the API's mapping says Unavailable; a write, the client's own error.
            if what == "get":
                raise Unavailable(f"run records (Redis) unreachable: {REFUSED}")
            raise self.write_error

    async def get(self, run_id: str) -> Run:
        self._fail("get")
        out = Run()
        out.CopyFrom(self.run)
        return out

    async def update(self, run_id: str, mutate: Callable[[Run], None], *, after_end: bool = False) -> Run:
        self._fail("update")
        mutate(self.run)
        return self.run


def test_the_step_watchdog_outlives_redis_errors_and_still_reports_the_stall(caplog: pytest.LogCaptureFixture) -> None:
    """Before, a write of the stall report that met Redis away ended the watchdog for the rest of the run, silently."""
    records, metrics = FlakyRecords(failures=2), RolloutMetrics()

    async def scenario() -> None:
        watchdog = asyncio.create_task(watch_progress(records, metrics, "run-1", stall_after_s=0.2))
        deadline = time.monotonic() + 5
        while not records.run.stalled:
            assert not watchdog.done(), f"the watchdog ended: {watchdog.exception()!r}"
            assert time.monotonic() < deadline, "the stall was never reported"
            await asyncio.sleep(0.05)
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)

    asyncio.run(scenario())
    assert records.errors == ["get", "get", "update", "update"]
    assert records.run.stalled.startswith("no progress for")
    assert "the step watchdog of run run-1 cannot reach the run's record" in caplog.text


class ReportingTrainer:
    """WatchSteps of a trainer that has made steps 1 to 3: each call replays them from `from_step`, then ends."""

    async def watch_steps(self, run_id: str, from_step: int = 0) -> AsyncIterator[StepReport]:
        for step in range(max(1, from_step), 4):
            yield StepReport(run_id=run_id, step=step, metrics={"loss": 1.0 / step})


@pytest.mark.parametrize(
    "write_error",
    [redis.ConnectionError(REFUSED), redis.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")],
    ids=["unreachable", "full"],
)
def test_step_reports_outlive_redis_errors_and_lose_none(
    write_error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a report that could not be written ended the follower: the run kept stale metrics to its end."""
    records = FlakyRecords(failures=2, write_error=write_error)

    async def scenario() -> bool:
        reports = StepReportFollower(ReportingTrainer(), records, "run-1", reconnect_after_s=0.05)  # type: ignore[arg-type]
        follower = asyncio.create_task(reports.follow())
        try:
            return await reports.caught_up(3, timeout_s=5)
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    assert asyncio.run(scenario()), "the report of step 3 never reached the record"
    assert records.run.metrics["loss"] == pytest.approx(1 / 3)
    assert "the trainer's step reports of run run-1 cannot be recorded" in caplog.text


def test_every_waiter_is_counted_at_0_from_the_start() -> None:
    """A first wait shows in rate() and increase() only if its series existed before it."""
    registry = RolloutMetrics().registry
    for waiter in REDIS_WAITERS:
        assert registry.get_sample_value("rlfleet_rollout_redis_outage_waits_total", {"waiter": waiter}) == 0
