"""The gRPC Runs service of a real orchestrator process: Submit, Get, List, Cancel and Watch, and
cancelling a run really stops it; and served in process over the Runs core: how a Watch ends when the
orchestrator shuts down, what a Watch leaves behind, and Redis down."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from google.protobuf import json_format
from grpc import aio
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from rollout_test_support import FakeFleet, Orchestrator, spec_json, wait_until
from trainer_release_support import runs_core

from rlfleet.api_token import ApiTokenGuard
from rlfleet.processes import free_port
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import (
    CancelRunRequest,
    GetRunRequest,
    ListRunsRequest,
    Run,
    RunEvent,
    RunSpec,
    RunState,
    SubmitRunRequest,
    WatchRunRequest,
)
from rlfleet.v1.runs_pb2_grpc import RunsStub
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.http_app import build_app
from rlfleet_rollout.runs_core import RunsCore


@pytest.fixture
def runs(orchestrator: Orchestrator) -> Iterator[RunsStub]:
    with grpc.insecure_channel(orchestrator.grpc_address) as channel:
        yield RunsStub(channel)


@pytest.fixture
def paused_trainer(fleet: FakeFleet) -> Iterator[None]:
    fleet.trainer.paused.set()
    yield
    fleet.trainer.paused.clear()


def _spec(tokenizer_dir: Path, **overrides: object) -> RunSpec:
    return json_format.ParseDict(spec_json(tokenizer_dir, **overrides), RunSpec())


@pytest.mark.e2e
def test_errors_map_to_status_codes(runs: RunsStub, tokenizer_dir: Path) -> None:
    with pytest.raises(grpc.RpcError) as missing:
        runs.Get(GetRunRequest(id="run-missing"), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as bad:
        runs.Submit(SubmitRunRequest(spec=_spec(tokenizer_dir, rollout={"group_size": 1})), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout.group_size" in bad.value.details()
    with pytest.raises(grpc.RpcError) as token:
        runs.List(ListRunsRequest(page_token="not-a-token"), timeout=5)
    assert token.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token" in token.value.details()


@pytest.mark.e2e
def test_submit_list_watch_and_cancel_a_running_and_a_queued_run(
    runs: RunsStub, fleet: FakeFleet, tokenizer_dir: Path, redis_client: redis.Redis, paused_trainer: None
) -> None:
    # The trainer takes no step, so run A stays RUNNING after producing step 0 and B stays QUEUED behind it.
    a = runs.Submit(SubmitRunRequest(spec=_spec(tokenizer_dir, name="a")), timeout=10)
    b = runs.Submit(SubmitRunRequest(spec=_spec(tokenizer_dir, name="b")), timeout=10)
    assert a.state == b.state == RunState.RUN_STATE_QUEUED
    assert runs.Get(GetRunRequest(id=b.id), timeout=5).spec.name == "b"

    events: list[RunEvent] = []
    watch = runs.Watch(WatchRunRequest(id=a.id), timeout=60)
    reader = threading.Thread(target=lambda: events.extend(watch))
    reader.start()
    wait_until(
        lambda: runs.Get(GetRunRequest(id=a.id), timeout=5).progress.groups_produced == 2, 20, "run a's first step"
    )
    assert runs.Get(GetRunRequest(id=b.id), timeout=5).state == RunState.RUN_STATE_QUEUED

    queued = runs.List(ListRunsRequest(state=RunState.RUN_STATE_QUEUED), timeout=5)
    assert [r.id for r in queued.runs] == [b.id]
    seen, token = [], ""
    for _ in range(100):  # page by page, in creation order
        page = runs.List(ListRunsRequest(page_size=1, page_token=token), timeout=5)
        assert len(page.runs) <= 1
        seen += [r.id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    assert seen[-2:] == [a.id, b.id]

    assert runs.Cancel(CancelRunRequest(id=b.id), timeout=5).state == RunState.RUN_STATE_CANCELLED
    cancelled = runs.Cancel(CancelRunRequest(id=a.id), timeout=5)
    assert cancelled.state == RunState.RUN_STATE_CANCELLED and cancelled.HasField("finished_at")
    with pytest.raises(grpc.RpcError) as again:
        runs.Cancel(CancelRunRequest(id=a.id), timeout=5)
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    wait_until(lambda: a.id in fleet.trainer.stop_calls, 10, "StopRun of the cancelled run")
    reader.join(timeout=10)
    assert not reader.is_alive(), "the watch did not end with the run"
    assert events[0].run.id == a.id
    assert events[-1].run.state == RunState.RUN_STATE_CANCELLED
    assert any(e.run.state == RunState.RUN_STATE_RUNNING for e in events)
    assert "CANCELLED" in events[-1].message

    stream = SampleStream(redis_client, a.id, prefix=fleet.prefix)
    assert stream.length() == 2
    time.sleep(0.5)
    assert stream.length() == 2  # nothing produced after the cancel
    assert b.id not in fleet.trainer.start_calls  # the queued run never started
    assert runs.Get(GetRunRequest(id=a.id), timeout=5).state == RunState.RUN_STATE_CANCELLED


@contextlib.asynccontextmanager
async def _served(core: RunsCore) -> AsyncIterator[RunsStub]:
    """The gRPC Runs service over `core` on a free loopback port, and a client of it."""
    guard = ApiTokenGuard(None, core.metrics.registry, "rollout")
    server, port = build_grpc_server(core, "127.0.0.1", 0, guard, keepalive_s=30)
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield RunsStub(channel)
    finally:
        await server.stop(grace=None)


def test_a_watch_ended_by_a_shutdown_is_unavailable_not_ok(redis_prefix: str) -> None:
    """The review's case: a Watch of a RUNNING run ended with status OK when the orchestrator stopped, so the
    README's `for event in runs.Watch(...)` loop just finished, as if the run had."""

    async def scenario() -> tuple[list[RunEvent], aio.AioRpcError]:
        async with runs_core(redis_prefix) as core, _served(core) as runs:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
            call = runs.Watch(WatchRunRequest(id="run-a"))
            events: list[RunEvent] = [await call.read()]
            core.close()  # what the orchestrator does at shutdown
            with pytest.raises(aio.AioRpcError) as ended:  # not the stream's end (EOF, status OK)
                while (event := await asyncio.wait_for(call.read(), timeout=10)) is not aio.EOF:
                    events.append(event)
            return events, ended.value

    events, ended = asyncio.run(scenario())
    assert [e.run.state for e in events] == [RunState.RUN_STATE_RUNNING]
    assert ended.code() == grpc.StatusCode.UNAVAILABLE
    assert ended.details() == "orchestrator shutting down; watch again"


def test_a_watch_leaves_nothing_behind_once_it_ends(redis_prefix: str) -> None:
    """The review's case: each Watch of an unknown or ended run kept an asyncio.Event for the life of the process."""

    async def scenario() -> tuple[tuple[int, int], tuple[int, int]]:
        async with runs_core(redis_prefix) as core, _served(core) as runs:
            await core.store.create(Run(id="run-done", state=RunState.RUN_STATE_SUCCEEDED))
            await core.store.create(Run(id="run-live", state=RunState.RUN_STATE_RUNNING))
            for i in range(20):
                with pytest.raises(aio.AioRpcError) as missing:
                    await runs.Watch(WatchRunRequest(id=f"run-missing-{i}")).read()
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                assert [e.run.id async for e in runs.Watch(WatchRunRequest(id="run-done"))] == ["run-done"]
            # Two watches of a live run share its reader and its event; both dropped, nothing is left either.
            first, second = runs.Watch(WatchRunRequest(id="run-live")), runs.Watch(WatchRunRequest(id="run-live"))
            await first.read()
            await second.read()
            watching = len(core.notifier._events), len(core.feeds._feeds)
            first.cancel()
            second.cancel()
            await asyncio.sleep(0.3)
            return watching, (len(core.notifier._events), len(core.feeds._feeds))

    watching, left = asyncio.run(scenario())
    assert (watching, left) == ((1, 1), (0, 0))


def test_a_request_naming_no_run_is_invalid_argument_naming_the_field(redis_prefix: str) -> None:
    """Before: NOT_FOUND "run '' not found", as if a run had been named and was missing."""

    async def scenario() -> list[aio.AioRpcError]:
        errors = []
        async with runs_core(redis_prefix) as core, _served(core) as runs:
            for call in (
                runs.Get(GetRunRequest(id=""), timeout=10),
                runs.Cancel(CancelRunRequest(id=""), timeout=10),
                runs.Watch(WatchRunRequest(id=""), timeout=10).read(),
            ):
                with pytest.raises(aio.AioRpcError) as refused:
                    await call
                errors.append(refused.value)
        return errors

    for error in asyncio.run(scenario()):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details() == "id: required: the id of a run, as Submit and List return it"


def test_an_unknown_state_filter_is_refused_alike_on_both_transports(redis_prefix: str) -> None:
    """Before: gRPC's List said only "state: unknown run state 99", where REST's named the states there are."""

    async def scenario() -> tuple[aio.AioRpcError, httpx.Response]:
        async with runs_core(redis_prefix) as core, _served(core) as runs:
            with pytest.raises(aio.AioRpcError) as refused:
                await runs.List(ListRunsRequest(state=99), timeout=10)  # type: ignore[arg-type]
            app = build_app(
                core,
                core.metrics,
                core.store.client,
                ApiTokenGuard(None, CollectorRegistry(), "rollout"),  # the served gRPC's guard has the core's
                watch_keepalive_s=15,
            )
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rest") as rest:
                return refused.value, await rest.get("/v1/runs", params={"state": "stalled"})

    grpc_error, rest_error = asyncio.run(scenario())
    known = "one of QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED"
    assert grpc_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_error.details() == f"state: unknown run state 99; {known}"
    assert rest_error.status_code == 400
    assert rest_error.json()["error"]["message"] == f"state: unknown run state 'stalled'; {known}"


def test_with_redis_unreachable_the_api_is_unavailable_naming_redis() -> None:
    """Before: INTERNAL "internal error" once the client's retries ran out, though nothing of ours was wrong."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def scenario() -> list[aio.AioRpcError]:
        errors = []
        async with runs_core("x:", url, retry=Retry(NoBackoff(), 0)) as core, _served(core) as runs:
            for call in (
                runs.Get(GetRunRequest(id="run-a"), timeout=10),
                runs.List(ListRunsRequest(), timeout=10),
                runs.Cancel(CancelRunRequest(id="run-a"), timeout=10),
                runs.Watch(WatchRunRequest(id="run-a"), timeout=10).read(),
            ):
                with pytest.raises(aio.AioRpcError) as failed:
                    await call
                errors.append(failed.value)
        return errors

    for error in asyncio.run(scenario()):
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert error.details().startswith("run records (Redis) unreachable: "), error.details()


def test_a_refusal_quoting_an_oversized_id_still_reaches_the_caller_with_its_code(redis_prefix: str) -> None:
    """A NotFound quoting a 100,000-character id whole outgrew what a gRPC status may carry: the caller heard
    RESOURCE_EXHAUSTED or INTERNAL instead of NOT_FOUND."""

    async def scenario() -> aio.AioRpcError:
        async with runs_core(redis_prefix) as core, _served(core) as runs:
            with pytest.raises(aio.AioRpcError) as refused:
                await runs.Get(GetRunRequest(id="r" * 100_000), timeout=10)
            return refused.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.NOT_FOUND, error
    assert error.details().startswith("run 'rrrr") and "characters" in error.details()
    assert len(error.details()) < 2000


def test_a_watch_of_a_run_that_failed_says_why_in_its_one_event(redis_prefix: str) -> None:
    """Before: "run run-f is FAILED", the reason given only to a watch that saw the run fail."""

    async def scenario() -> list[RunEvent]:
        async with runs_core(redis_prefix) as core, _served(core) as runs:
            await core.store.create(Run(id="run-f", state=RunState.RUN_STATE_FAILED, error="the trainer is gone"))
            return [event async for event in runs.Watch(WatchRunRequest(id="run-f"), timeout=10)]

    events = asyncio.run(scenario())
    assert [e.message for e in events] == ["run run-f is FAILED: the trainer is gone"]
