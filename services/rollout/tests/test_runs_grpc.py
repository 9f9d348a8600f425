"""The gRPC Runs service of a real orchestrator process: Submit, Get, List, Cancel and Watch, and
cancelling a run really stops it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from google.protobuf import json_format
from rollout_test_support import FakeFleet, Orchestrator, spec_json, wait_until

from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import (
    CancelRunRequest,
    GetRunRequest,
    ListRunsRequest,
    RunEvent,
    RunSpec,
    RunState,
    SubmitRunRequest,
    WatchRunRequest,
)
from rlfleet.v1.runs_pb2_grpc import RunsStub


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
