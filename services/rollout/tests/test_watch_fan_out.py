"""Many watchers of a run cost Redis one read per change, and never take the run loop's connections.

The review's case: each change woke every watcher of the run, and each read the record over a connection of the one
client the run loop writes through; at 150 watchers redis-py's pool (100) ran out, MaxConnectionsError, and the
running run was recorded FAILED "Redis was unreachable for longer than 30s". Now the watchers of a run share one
reader of its record (run_events.RunFeed), and the API's callers have a client of their own whose pool waits for a
free connection rather than failing (orchestrator.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from rollout_test_support import (
    REDIS_URL,
    FakeFleet,
    Orchestrator,
    delete_prefix,
    spec_json,
    start_fake_fleet,
    start_orchestrator,
    wait_for_state,
)
from trainer_release_support import runs_core

from rlfleet.sample_stream import connect_redis_async
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore

WATCHERS = 150
FINAL_STATES = ("RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED", "RUN_STATE_CANCELLED")
CHANGES = 10
POLL_INTERVAL_S = 0.5


async def _until(done: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {within_s:g} s"
        await asyncio.sleep(0.02)


def _count_reads(store: RunStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run ids `store.get` is asked for from now on, one entry per read of a record."""
    reads: list[str] = []
    get = store.get

    async def counted(run_id: str) -> Run:
        reads.append(run_id)
        return await get(run_id)

    monkeypatch.setattr(store, "get", counted)
    return reads


@dataclass
class Watched:
    seen: list[list[Run]]
    """The runs each watch yielded."""
    ended: list[BaseException | None]
    """How each watch ended: None once the run did."""
    writes_s: float
    """From the first write to the end of the last watch."""
    reads: int
    """Records read meanwhile (counted by `_count_reads`)."""


async def _watch_while_the_run_loop_writes(
    core: RunsCore, reads: list[str], alongside: Callable[[], Awaitable[object]] | None = None
) -> Watched:
    """WATCHERS watches of the RUNNING run-a, then CHANGES progress writes of the run loop's and the one that ends
    the run, with `alongside` running meanwhile."""
    seen: list[list[Run]] = [[] for _ in range(WATCHERS)]

    async def watch(i: int) -> None:
        async for event in core.watch("run-a"):
            seen[i].append(event.run)

    def set_step(step: int) -> Callable[[Run], None]:
        return lambda run: setattr(run.progress, "step", step)

    watchers = [asyncio.create_task(watch(i)) for i in range(WATCHERS)]
    try:
        await _until(lambda: all(seen) or any(w.done() for w in watchers), 10, "first event of every watch")
        started, reads_before = time.monotonic(), len(reads)
        other = asyncio.ensure_future(alongside()) if alongside is not None else None
        for step in range(1, CHANGES + 1):
            await core.update("run-a", set_step(step))
            await asyncio.sleep(0.01)
        await core.update("run-a", lambda run: setattr(run, "state", RunState.RUN_STATE_SUCCEEDED))
        await asyncio.wait(watchers, timeout=10)
        writes_s, reads_during = time.monotonic() - started, len(reads) - reads_before
        if other is not None:
            await asyncio.wait_for(other, 10)
        ended = [w.exception() if w.done() else TimeoutError("still watching after 10 s") for w in watchers]
        return Watched(seen, ended, writes_s, reads_during)
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


def _check_every_watch_followed_the_run_to_its_end(watched: Watched) -> None:
    assert watched.ended == [None] * WATCHERS, next(e for e in watched.ended if e is not None)
    for runs in watched.seen:
        steps = [run.progress.step for run in runs]
        assert steps == sorted(steps), steps  # the latest state after each change, never an older one
        assert runs[-1].state == RunState.RUN_STATE_SUCCEEDED and runs[-1].progress.step == CHANGES


def test_many_watchers_share_one_reader_and_the_run_loops_writes_go_through(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One client for the run loop and the API, as before, with a pool far smaller than the watchers that fails at
    once when all its connections are in use (as redis-py's default pool of 100 did at 150 watchers). The run
    loop's writes go through, and the record is read once per change and per poll interval, not per watcher."""

    async def scenario() -> Watched:
        async with runs_core(redis_prefix, poll_interval_s=POLL_INTERVAL_S, max_connections=8) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            return await _watch_while_the_run_loop_writes(core, _count_reads(core.store, monkeypatch))

    watched = asyncio.run(scenario())
    _check_every_watch_followed_the_run_to_its_end(watched)
    most = CHANGES + 1 + int(watched.writes_s / POLL_INTERVAL_S) + 1
    assert watched.reads <= most, (
        f"{watched.reads} reads of the record for {CHANGES + 1} changes and {WATCHERS} watchers"
    )


def test_the_apis_callers_wait_for_connections_of_their_own_while_the_run_loop_writes(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator's two clients: the run loop's holds 2 connections and fails at once beyond them, the API's
    holds 4 and waits for a free one. 150 watchers and 300 Gets at once while the run loop writes: none fails, so
    none took a connection of the run loop's."""

    async def scenario() -> tuple[Watched, list[Run]]:
        run_loop = aioredis.Redis.from_url(REDIS_URL, max_connections=2, socket_timeout=5)
        api = connect_redis_async(REDIS_URL, timeout_s=5, max_connections=4)
        try:
            async with httpx.AsyncClient() as http:
                core = RunsCore(
                    RunStore(run_loop, redis_prefix),
                    RewardClient(http, "http://127.0.0.1:9", score_timeout_s=1, validate_timeout_s=1),
                    RunNotifier(),
                    RolloutMetrics(),
                    filters=FilterRegistry({}),
                    rollouts=RolloutRegistry.from_entry_points(),
                    poll_interval_s=POLL_INTERVAL_S,
                    run_data_retention_s=60,
                    api_store=RunStore(api, redis_prefix),
                )
                await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
                gets: list[Run] = []

                async def callers() -> None:
                    gets.extend(await asyncio.gather(*(core.get("run-a") for _ in range(300))))

                reads = _count_reads(core.api_store, monkeypatch)
                return await _watch_while_the_run_loop_writes(core, reads, alongside=callers), gets
        finally:
            await run_loop.aclose()
            await api.aclose()

    watched, gets = asyncio.run(scenario())
    _check_every_watch_followed_the_run_to_its_end(watched)
    assert len(gets) == 300 and all(run.id == "run-a" for run in gets)


@pytest.fixture(scope="module")
def busy_fleet(redis_client: redis.Redis) -> Iterator[FakeFleet]:
    """A fake fleet of its own: its run takes every step it can while the test watches."""
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:12]}:"
    fleet = start_fake_fleet(redis_client, prefix)
    yield fleet
    fleet.stop()
    delete_prefix(redis_client, prefix)


@pytest.fixture(scope="module")
def busy_orchestrator(busy_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Orchestrator]:
    orch = start_orchestrator(busy_fleet, tmp_path_factory.mktemp("logs") / "rollout.log")
    yield orch
    orch.process.stop(timeout=15)


@pytest.mark.e2e
def test_a_running_run_outlives_150_rest_watchers_and_each_watch_follows_it_to_its_end(
    busy_orchestrator: Orchestrator, tokenizer_dir: Path
) -> None:
    """The review's reproduction: a real orchestrator, a running run, 150 REST watchers that watch again when a
    stream ends before the run did (as `rlfleet watch` does). Before, the run was FAILED within seconds ("Redis was
    unreachable for longer than 30s: MaxConnectionsError: Too many connections"), and watches were refused (503) or
    ended with it still running."""
    url = busy_orchestrator.url
    submitted = httpx.post(f"{url}/v1/runs", json=spec_json(tokenizer_dir, schedule={"steps": 400}), timeout=10)
    run_id = submitted.json()["id"]
    wait_for_state(url, run_id, {"RUN_STATE_RUNNING"}, 30)

    async def watch_then_cancel() -> tuple[dict[str, Any], int, list[BaseException | None], list[list[str]]]:
        states: list[list[str]] = [[] for _ in range(WATCHERS)]
        ended_early = 0

        async def watch(client: httpx.AsyncClient, i: int) -> None:
            nonlocal ended_early
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("GET", f"{url}/v1/runs/{run_id}:watch") as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data:"):
                                states[i].append(json.loads(line[5:])["state"])
                                if states[i][-1] in FINAL_STATES:
                                    return
                ended_early += 1
                await asyncio.sleep(0.2)

        limits = httpx.Limits(max_connections=WATCHERS + 10)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10, read=30)) as client:
            watchers = [asyncio.create_task(watch(client, i)) for i in range(WATCHERS)]
            try:
                await _until(lambda: all(states), 20, "first event of every watch")
                await asyncio.sleep(3)  # the run goes on, and each of its changes reaches 150 watchers
                running = (await client.get(f"{url}/v1/runs/{run_id}")).json()
                early = ended_early
                await client.post(f"{url}/v1/runs/{run_id}:cancel")
                await asyncio.wait(watchers, timeout=15)
                ended = [w.exception() if w.done() else TimeoutError("still watching") for w in watchers]
            finally:
                for w in watchers:
                    w.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
        return running, early, ended, states

    running, ended_early, ended, states = asyncio.run(watch_then_cancel())
    assert running["state"] == "RUN_STATE_RUNNING", running.get("error")
    assert int(running["progress"].get("step", 0)) > 0
    assert ended_early == 0
    assert ended == [None] * WATCHERS, next(e for e in ended if e is not None)
    assert all(seen[-1] == "RUN_STATE_CANCELLED" for seen in states)
    log = busy_orchestrator.process.log_tail(lines=10_000)
    assert "Too many connections" not in log and "No connection available" not in log
