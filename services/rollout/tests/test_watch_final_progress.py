"""A watch of a run that ends shows the run as its driver left it: the trainer's final progress, recorded once the
trainer has stopped the run (after its step in progress), is in the watch's last event, and that event is the one
event of the run's end.

The case: a Cancel records CANCELLED at once; the driver then stops the trainer and records what the trainer did up
to the stop (its step, weight version and groups trained). Every watch (the core's, the REST stream, the gRPC
Watch) ended on the CANCELLED it read first, with the progress before the stop, while Get showed the final one. The
run is driven by a run queue holding its lease (run_lease.py), in process over the real Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from grpc import aio
from trainer_release_support import StopOnlyTrainer, run_deps, runs_core

from rlfleet.api_token import ApiTokenGuard
from rlfleet.v1.runs_pb2 import Run, RunEvent, RunProgress, RunState, WatchRunRequest
from rlfleet.v1.runs_pb2_grpc import RunsStub
from rlfleet.v1.trainer_pb2 import TrainerStatus
from rlfleet_rollout import run_loop
from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.http_app import END_EVENT_ID, build_app
from rlfleet_rollout.run_lease import RunLease
from rlfleet_rollout.run_queue import RunQueue
from rlfleet_rollout.runs_core import RunsCore
from rlfleet_rollout.trainer_session import TrainerSession

CANCELLED = RunState.RUN_STATE_CANCELLED
# What the stub trainer reports at its stop, after the step it finished past the cancel (the record held step 3).
FINAL = (4, 4, 8)


class SlowToStopTrainer(StopOnlyTrainer):
    """Stops the run after `stop_after_s` (its step in progress), then reports FINAL; never, when that is None."""

    def __init__(self, core: RunsCore, stop_after_s: float | None) -> None:
        super().__init__(core)
        self.stop_after_s = stop_after_s

    async def stop_run(self, run_id: str) -> TrainerStatus:
        await asyncio.sleep(3600 if self.stop_after_s is None else self.stop_after_s)
        return await super().stop_run(run_id)


async def _drive(run: Run, session: TrainerSession, deps: run_loop.RunDeps) -> None:
    await asyncio.sleep(3600)  # a step in progress: only a Cancel ends it


async def _nothing() -> None:
    return None


async def _until(done: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await done():
        assert time.monotonic() < deadline, f"no {what} within {within_s:g}s"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _driven(core: RunsCore, trainer: StopOnlyTrainer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """run-a, RUNNING at step 3, driven by a run queue that holds its lease."""
    monkeypatch.setattr(run_loop, "_drive", _drive)
    progress = RunProgress(step=3, weight_version=3, groups_trained=6, total_steps=10)
    await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED, progress=progress))
    lease = RunLease(core.store.client, core.store.prefix, ttl_s=5.0, token="orchestrator-a")
    queue = RunQueue(run_deps(core, trainer), lease)
    monkeypatch.setattr(queue, "_free_trainer", _nothing)
    serving = asyncio.create_task(queue.serve())
    try:

        async def running() -> bool:
            assert not serving.done(), f"the queue ended: {serving.exception()!r}"
            return (await core.get("run-a")).state == RunState.RUN_STATE_RUNNING

        await _until(running, 10, "RUNNING run-a")
        yield
    finally:
        await cancel_and_wait(serving)


@contextlib.asynccontextmanager
async def _clients(core: RunsCore) -> AsyncIterator[tuple[httpx.AsyncClient, RunsStub]]:
    """The REST app (in process) and the gRPC service (on a free loopback port) over `core`, and a client of each."""
    guard = ApiTokenGuard(None, core.metrics.registry, "rollout")
    app = build_app(core, core.metrics, core.store.client, guard, watch_keepalive_s=15.0)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    server, port = build_grpc_server(core, "127.0.0.1", 0, guard, keepalive_s=30)
    await server.start()
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://rollout") as rest,
            aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            yield rest, RunsStub(channel)
    finally:
        await server.stop(grace=None)


def _sse_events(body: str) -> list[tuple[str | None, Run]]:
    """Each event of a REST watch stream: its id (None without one) and its run."""
    events = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            events.append((fields.get("id"), json_format.ParseDict(json.loads(fields["data"]), Run())))
    return events


def _progress(run: Run) -> tuple[int, int, int]:
    p = run.progress
    return p.step, p.weight_version, p.groups_trained


@pytest.mark.parametrize("stop_after_s", [0.0, 0.5])
def test_every_watch_of_a_cancelled_run_ends_with_the_trainers_final_progress(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, stop_after_s: float
) -> None:
    async def scenario() -> tuple[list[RunEvent], list[tuple[str | None, Run]], list[RunEvent], Run, int]:
        async with runs_core(redis_prefix, poll_interval_s=0.05) as core, _clients(core) as (rest, runs):
            trainer = SlowToStopTrainer(core, stop_after_s)
            async with _driven(core, trainer, monkeypatch):
                core_events: list[RunEvent] = []

                async def watch_core() -> None:
                    async for event in core.watch("run-a"):
                        core_events.append(event)

                async def watch_grpc() -> list[RunEvent]:
                    return [event async for event in runs.Watch(WatchRunRequest(id="run-a"))]

                watchers: list[asyncio.Future[Any]] = [
                    asyncio.ensure_future(watch_core()),
                    asyncio.ensure_future(rest.get("/v1/runs/run-a:watch", timeout=20)),
                    asyncio.ensure_future(watch_grpc()),
                ]
                await asyncio.sleep(0.3)  # each watch has shown the RUNNING run
                cancelled = await core.cancel("run-a")
                assert _progress(cancelled) == (3, 3, 6)
                done, _ = await asyncio.wait(watchers, timeout=20)
                assert len(done) == 3, "a watch did not end with the run"
                response, grpc_events = watchers[1].result(), watchers[2].result()
                assert response.status_code == 200

                async def stopped() -> bool:
                    return _progress(await core.get("run-a")) == FINAL

                await _until(stopped, 10, "final progress in run-a's record")
                final = await core.get("run-a")
                again = await rest.get("/v1/runs/run-a:watch", headers={"Last-Event-ID": END_EVENT_ID}, timeout=10)
            return core_events, _sse_events(response.text), grpc_events, final, again.status_code

    core_events, sse, grpc_events, final, again = asyncio.run(scenario())
    assert final.state == CANCELLED and _progress(final) == FINAL, "Get shows the trainer's final progress"
    for name, runs_seen in [
        ("core", [e.run for e in core_events]),
        ("REST", [run for _, run in sse]),
        ("gRPC", [e.run for e in grpc_events]),
    ]:
        assert runs_seen[0].state == RunState.RUN_STATE_RUNNING, name
        assert [r.state == CANCELLED for r in runs_seen].count(True) == 1, f"{name}: one event of the run's end"
        assert runs_seen[-1] == final, f"{name}: the last event is the run as Get shows it: {runs_seen[-1]}"
    assert [event_id for event_id, _ in sse] == [None] * (len(sse) - 1) + [END_EVENT_ID]
    assert "CANCELLED" in grpc_events[-1].message and "CANCELLED" in core_events[-1].message
    assert again == 204, "a reconnect after the end is told nothing more comes"


def test_a_watch_that_starts_while_the_trainer_stops_gets_the_run_as_recorded_at_once(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch of a run that has ended answers at once with the run as it stands, as Get does, and ends; it does not
    wait for the driver to let go of the run."""

    async def scenario() -> tuple[list[Run], float]:
        async with runs_core(redis_prefix, poll_interval_s=0.05) as core:
            async with _driven(core, SlowToStopTrainer(core, stop_after_s=None), monkeypatch):
                await core.cancel("run-a")
                started = time.monotonic()
                seen = [event.run async for event in core.watch("run-a")]
                return seen, time.monotonic() - started

    seen, took = asyncio.run(scenario())
    assert [run.state for run in seen] == [CANCELLED] and _progress(seen[0]) == (3, 3, 6)
    assert took < 1.0


def test_a_driver_that_does_not_let_go_of_its_run_holds_its_watch_for_a_bounded_time(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer never stops (StopRun goes unanswered): the watch ends with the run as recorded once the bound on
    waiting for its final progress has passed, not when the driver gives up on the trainer (--step-timeout)."""

    async def scenario() -> tuple[list[Run], float]:
        async with runs_core(redis_prefix, poll_interval_s=0.05) as core:
            core.feeds.end_wait_s = 0.5
            async with _driven(core, SlowToStopTrainer(core, stop_after_s=None), monkeypatch):
                seen: list[Run] = []

                async def watch() -> None:
                    async for event in core.watch("run-a"):
                        seen.append(event.run)

                watcher = asyncio.ensure_future(watch())
                await asyncio.sleep(0.3)
                await core.cancel("run-a")
                cancelled_at = time.monotonic()
                await asyncio.wait_for(watcher, 10)
                return seen, time.monotonic() - cancelled_at

    seen, took = asyncio.run(scenario())
    assert [run.state for run in seen] == [RunState.RUN_STATE_RUNNING, CANCELLED]
    assert 0.4 < took < 2.0, f"the watch ended {took:.2f}s after the cancel"


def test_a_shutdown_while_the_end_is_held_back_gives_the_watch_the_end_as_recorded(redis_prefix: str) -> None:
    """The run ended, and its driver (another orchestrator, holding its lease) has not let go of it: a shutdown here
    ends the watch with the run's end as recorded, not with "watch again" for a run that is over."""

    async def scenario() -> list[Run]:
        async with runs_core(redis_prefix, poll_interval_s=0.05) as core:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            driver = RunLease(core.store.client, core.store.prefix, ttl_s=30.0, token="orchestrator-b")
            assert await driver.hold("run-a")
            seen: list[Run] = []

            async def watch() -> None:
                async for event in core.watch("run-a"):
                    seen.append(event.run)

            watcher = asyncio.ensure_future(watch())
            await asyncio.sleep(0.2)
            await core.cancel("run-a")
            await asyncio.sleep(0.3)
            assert [run.state for run in seen] == [RunState.RUN_STATE_RUNNING], "the end was not held back"
            core.close()
            await asyncio.wait_for(watcher, 5)
            return seen

    seen = asyncio.run(scenario())
    assert [run.state for run in seen] == [RunState.RUN_STATE_RUNNING, CANCELLED]
