"""rlfleet_rollout_runs, runs by state, says what the run store holds, on every orchestrator sharing it: each
one counts the records again (every few seconds, and right after it changes a run) instead of moving the counts
by its own changes only, which left one orchestrator's gauge negative and the other's stale."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from rollout_test_support import REDIS_URL, spec_json, start_fake_fleet, start_orchestrator, wait_for_state, wait_until

from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_counts import RunCounts
from rlfleet_rollout.run_store import RunStore


def _stored(url: str) -> dict[str, float]:
    """Runs by state as the store holds them (the Runs API reads every record)."""
    counts: dict[str, float] = {}
    for run in httpx.get(f"{url}/v1/runs", params={"page_size": 1000}, timeout=5).json().get("runs", []):
        state = run["state"].removeprefix("RUN_STATE_").lower()
        counts[state] = counts.get(state, 0.0) + 1
    return counts


def _gauge(url: str) -> dict[str, float]:
    """The states rlfleet_rollout_runs counts any run in."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.findall(r'^rlfleet_rollout_runs\{state="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {state: float(value) for state, value in found if float(value) != 0}


@pytest.mark.e2e
def test_two_orchestrators_on_one_redis_both_count_the_runs_the_store_holds(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A run submitted through one orchestrator and cancelled through the other: counted by each process's own
    changes, the first showed it queued (or running) for good and the second -1 queued (or running), 1 cancelled."""
    fleet = start_fake_fleet(redis_client, redis_prefix)
    orchestrators = []
    try:
        for name in ("a", "b"):
            orchestrators.append(start_orchestrator(fleet, tmp_path / f"{name}.log"))
        a, b = orchestrators
        fleet.trainer.paused.set()  # the run stays RUNNING until it is cancelled
        run_id = httpx.post(f"{a.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        wait_for_state(a.url, run_id, {"RUN_STATE_RUNNING"}, 20)
        wait_until(lambda: all(_gauge(o.url) == {"running": 1} for o in orchestrators), 15, "both to count it running")
        assert httpx.post(f"{b.url}/v1/runs/{run_id}:cancel", timeout=10).status_code == 200
        assert _stored(a.url) == {"cancelled": 1}
        wait_until(
            lambda: all(_gauge(o.url) == {"cancelled": 1} for o in orchestrators),
            15,
            f"both to count it cancelled (a: {_gauge(a.url)}, b: {_gauge(b.url)})",
        )
    finally:
        for orch in orchestrators:
            orch.process.stop(timeout=15)
        fleet.stop()


def _counted(metrics: RolloutMetrics) -> dict[str, float]:
    samples = metrics.registry.get_sample_value
    states = [RunState.Name(s).removeprefix("RUN_STATE_").lower() for s in RunState.values() if s]
    return {state: value for state in states if (value := samples("rlfleet_rollout_runs", {"state": state}))}


def test_the_counts_follow_the_store_and_a_redis_error_keeps_the_last_ones(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs another process writes are counted by the next pass (or at once after a change here); Redis failing
    leaves the last counts, logged once per outage, and the task ends when cancelled."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        # Nothing listens on port 9: every command fails at once, as with Redis down beyond the client's retries.
        down = aioredis.Redis.from_url("redis://127.0.0.1:9/0", socket_connect_timeout=1, retry=None)
        try:
            store, metrics = RunStore(client, redis_prefix), RolloutMetrics()
            counts = RunCounts(store, metrics, every_s=0.05)
            task = asyncio.create_task(counts.serve())
            for i, state in enumerate(
                [RunState.RUN_STATE_QUEUED, RunState.RUN_STATE_QUEUED, RunState.RUN_STATE_FAILED]
            ):
                await store.create(Run(id=f"run-{i}", state=state))  # another orchestrator's writes
            await _until(lambda: _counted(metrics) == {"queued": 2, "failed": 1})

            counts.every_s = 60.0
            await asyncio.sleep(0.1)  # the task now waits for a change, not for the interval
            await store.create(Run(id="run-3", state=RunState.RUN_STATE_RUNNING))
            counts.changed()
            await _until(lambda: _counted(metrics) == {"queued": 2, "failed": 1, "running": 1})

            counts.store = RunStore(down, redis_prefix)
            with caplog.at_level(logging.WARNING, logger="rlfleet_rollout.run_counts"):
                assert not await counts.refresh()
                assert not await counts.refresh()
            assert _counted(metrics) == {"queued": 2, "failed": 1, "running": 1}
            assert [r.message.split(";")[0] for r in caplog.records] == ["counting runs by state failed"]
            counts.store = store
            assert await counts.refresh()

            assert await cancel_and_wait(task, within_s=5)
            assert task.cancelled()
        finally:
            await client.aclose()
            await down.aclose()

    asyncio.run(scenario())


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
