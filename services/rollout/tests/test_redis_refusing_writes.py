"""Redis that answers but refuses writes (full at maxmemory, a read-only replica after a failover, unable to persist:
MISCONF) is waited out as an outage is: the run stays RUNNING and goes on once Redis takes writes again, the run
queue and the Runs API outlive it (503 naming Redis), and nothing is failed as an "internal error". Before, the
first refused write failed the run, its FAILED record could not be written, the run queue's task died and the
orchestrator exited 0 with the run RUNNING. The tests that make Redis refuse writes use a redis-server of their own
on a free port."""

from __future__ import annotations

import asyncio
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rollout_test_support import REDIS_URL, spec_json, start_fake_fleet, start_orchestrator, wait_for_state, wait_until
from test_redis_outage import PrivateRedis
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core

from rlfleet.errors import Unavailable
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.sample_stream import redis_refusal, redis_unavailable
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout import run_loop
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.redis_outage import until_redis_answers
from rlfleet_rollout.trainer_session import TrainerSession

RUNNING, FAILED = RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_FAILED


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    (tmp_path / "redis").mkdir()  # a directory of its own, which _cannot_persist removes
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    yield server
    if server.process is not None:
        server.process.stop(timeout=5)


# Each makes the Redis of `client` refuse writes one way, and returns what ends it.


def _full(client: redis.Redis) -> Callable[[], object]:
    client.config_set("maxmemory", 1)  # noeviction, the default: every write that may use memory is refused (OOM)
    return lambda: client.config_set("maxmemory", 0)


def _read_only(client: redis.Redis) -> Callable[[], object]:
    client.replicaof("127.0.0.1", free_port())  # a replica of a primary that is gone: READONLY
    return lambda: client.replicaof("NO", "ONE")


def _cannot_persist(client: redis.Redis) -> Callable[[], object]:
    """A snapshot that cannot be written (its directory is gone) stops writes: MISCONF."""
    client.config_set("save", "3600 1")
    shutil.rmtree(str(client.config_get("dir")["dir"]))
    client.bgsave()
    wait_until(lambda: client.info("persistence")["rdb_last_bgsave_status"] == "err", 10, "the snapshot to fail")
    # No snapshot at shutdown either: it would fail too, and redis-server refuse to stop.
    return lambda: client.config_set("stop-writes-on-bgsave-error", "no", "save", "")


def _too_few_replicas(client: redis.Redis) -> Callable[[], object]:
    client.config_set("min-replicas-to-write", 1)  # and it has none: NOREPLICAS
    return lambda: client.config_set("min-replicas-to-write", 0)


REFUSALS = {
    "full": (_full, "(OOM)"),
    "read-only": (_read_only, "(READONLY)"),
    "no disk": (_cannot_persist, "(MISCONF"),
    "no replicas": (_too_few_replicas, "(NOREPLICAS)"),
}


@pytest.mark.parametrize("kind", REFUSALS)
def test_refused_writes_are_waited_out_and_the_api_answers_unavailable_naming_redis(
    private_redis: PrivateRedis, kind: str
) -> None:
    refuse, code = REFUSALS[kind]
    client = redis.Redis.from_url(private_redis.url)
    metrics = RolloutMetrics()

    def mark_failed(run: Run) -> None:
        run.state = FAILED

    async def scenario() -> Run:
        async with runs_core("p:", url=private_redis.url) as core:
            await core.store.create(Run(id="run-a", state=RUNNING))
            allow = refuse(client)
            with pytest.raises(Unavailable, match=r"^run records \(Redis\) refuse writes: Redis ") as refused:
                await core.cancel("run-a")
            assert code in str(refused.value)
            asyncio.get_running_loop().call_later(0.3, allow)
            # As the run loop records a run's final state: waited for, not raised.
            await until_redis_answers(
                lambda: core.update("run-a", mark_failed), "final run record", metrics, first_wait_s=0.05
            )
            return await core.get("run-a")

    assert asyncio.run(scenario()).state == FAILED
    assert metrics.redis_outage_waits.labels(waiter="final run record")._value.get() >= 1
    client.close()


def test_only_redis_refusing_writes_is_taken_for_it() -> None:
    """Another error is raised at once (waiting would hide a fault of ours for good), though the command it quotes
    holds a refusal's word."""
    wrong_type = redis.ResponseError(
        "Command # 1 (SET k MISCONF x) of pipeline caused error: ('WRONGTYPE Operation against a key holding the "
        "wrong kind of value',)"
    )
    assert redis_refusal(wrong_type) is None and not redis_unavailable(wrong_type)
    assert redis_refusal(redis.ResponseError("MISCONF Redis is configured to save RDB snapshots")) is not None
    assert "(MASTERDOWN)" in str(redis_refusal(redis.ResponseError("MASTERDOWN Link with MASTER is down and ...")))


def test_a_run_that_meets_refused_writes_is_left_running_not_failed(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis was full for a moment: the run is not failed (nor its trainer stopped) but handed back to the queue,
    which resumes it from its records."""
    client = redis.Redis.from_url(private_redis.url)

    async def drive(run: Run, session: TrainerSession, deps: run_loop.RunDeps) -> None:
        allow = _full(client)
        try:
            await deps.core.update(run.id, _note_progress)
        finally:
            allow()  # Redis takes writes again by the time the run loop would record the run's end

    monkeypatch.setattr(run_loop, "_drive", drive)

    async def scenario() -> tuple[Run, StopOnlyTrainer]:
        async with runs_core("p:", url=private_redis.url) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED))
            trainer = StopOnlyTrainer(core)
            with pytest.raises(redis.OutOfMemoryError):
                await asyncio.wait_for(run_loop.execute_run("run-a", run_deps(core, trainer)), timeout=15)
            return await core.get("run-a"), trainer

    final, trainer = asyncio.run(scenario())
    assert final.state == RUNNING and final.error == ""
    assert trainer.states_seen == [], "the trainer is not stopped: the run goes on"
    client.close()


def _note_progress(run: Run) -> None:
    run.progress.groups_produced += 1


@pytest.mark.e2e
def test_the_orchestrator_outlives_a_full_redis_and_the_run_goes_on(
    private_redis: PrivateRedis, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The review's case, end to end: Redis fills up while a run trains."""
    client = redis.Redis.from_url(private_redis.url)
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:8]}:"
    fleet = start_fake_fleet(client, prefix)
    orch = start_orchestrator(fleet, tmp_path / "rollout.log", env={"RLFLEET_ROLLOUT_REDIS_URL": private_redis.url})
    try:
        fleet.trainer.paused.set()
        spec = spec_json(tokenizer_dir, schedule={"steps": 3, "eval_every": 0})
        run_id = httpx.post(f"{orch.url}/v1/runs", json=spec, timeout=20).json()["id"]
        wait_until(lambda: client.hexists(f"{prefix}run:{run_id}:data_position", "1"), 20, "step 0 produced")
        allow = _full(client)
        fleet.trainer.paused.clear()  # step 0 is trained: recording it meets the full Redis

        def waits() -> float:
            line = 'rlfleet_rollout_redis_outage_waits_total{waiter="run queue"}'
            text = httpx.get(f"{orch.url}/metrics", timeout=5).text
            return sum(float(row.split()[-1]) for row in text.splitlines() if row.startswith(line))

        wait_until(lambda: waits() >= 1, 20, "the run queue to wait for Redis")
        assert orch.process.alive(), orch.process.log_tail()
        run: dict[str, Any] = httpx.get(f"{orch.url}/v1/runs/{run_id}", timeout=5).json()
        assert run["state"] == "RUN_STATE_RUNNING" and not run.get("error"), run
        cancel = httpx.post(f"{orch.url}/v1/runs/{run_id}:cancel", timeout=10)
        assert cancel.status_code == 503, cancel.text
        assert cancel.json()["error"]["message"].startswith("run records (Redis) refuse writes: ")

        allow()
        final = wait_for_state(orch.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=30)
        assert final["state"] == "RUN_STATE_SUCCEEDED", final
        log = (tmp_path / "rollout.log").read_text()
        assert f"resuming run {run_id}" in log and "internal error" not in log
    finally:
        code = orch.process.stop(timeout=15)
        fleet.stop()
        client.close()
    assert code == 0, orch.process.log_tail()


def test_the_orchestrator_exits_non_zero_when_its_run_queue_dies(
    redis_client: redis.Redis, redis_prefix: str, tmp_path: Path
) -> None:
    """A fault the queue cannot wait out (here a lease of the wrong type) ends the process with status 1 and the error
    in its log, for its supervisor to see and restart it; before, it exited 0, and the queued run waited unnoticed."""
    queued = Run(id="run-a", state=RunState.RUN_STATE_QUEUED)
    redis_client.set(f"{redis_prefix}run:run-a:record", queued.SerializeToString())
    redis_client.zadd(f"{redis_prefix}runs:index", {"run-a": 1})
    redis_client.hset(f"{redis_prefix}run:run-a:driver", "not", "a lease")
    env = {
        "RLFLEET_ROLLOUT_REDIS_URL": REDIS_URL,
        "RLFLEET_ROLLOUT_REDIS_PREFIX": redis_prefix,
        "RLFLEET_ROLLOUT_TRAINER_ADDRESS": f"127.0.0.1:{free_port()}",  # nobody: the start-up check only warns
        "RLFLEET_ROLLOUT_TRAINER_CALL_TIMEOUT_S": "2",
        "RLFLEET_ROLLOUT_SHUTDOWN_GRACE_S": "0",
        "RLFLEET_LOG_FORMAT": "text",
    }
    argv = [sys.executable, "-m", "rlfleet_rollout", "--port", str(free_port()), "--grpc-port", str(free_port())]
    process = ServiceProcess("rollout", argv, tmp_path / "rollout.log", env=env)
    try:
        wait_until(lambda: not process.alive(), 30, "the orchestrator to exit")
    finally:
        code = process.stop(timeout=5)
    log = process.log_tail(200)
    assert code == 1, log
    assert "ERROR rlfleet_rollout.orchestrator: run queue stopped: ResponseError: " in log and "WRONGTYPE" in log, log
