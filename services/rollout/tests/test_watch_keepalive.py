"""A watch of a quiet run stays open: the REST stream sends keep-alive comments between events, and the
gRPC server lets a client's keepalive pings (its way to notice a vanished server) through instead of
ending the watch with "too many pings"."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from rollout_test_support import FakeFleet, Orchestrator, delete_prefix, spec_json, start_fake_fleet, start_orchestrator

from rlfleet.grpc_keepalive import channel_keepalive_options
from rlfleet.v1.runs_pb2 import WatchRunRequest
from rlfleet.v1.runs_pb2_grpc import RunsStub
from rlfleet_rollout.sse_keepalive import KEEPALIVE, with_keepalive

WATCH_KEEPALIVE_S = 0.3
GRPC_KEEPALIVE_S = 1.5
"""Clients may then ping every 0.5 s; the test's client pings every second."""


async def _slow(items: list[tuple[float, str]], closed: list[bool]) -> AsyncIterator[str]:
    try:
        for delay, item in items:
            await asyncio.sleep(delay)
            yield item
    finally:
        closed.append(True)


def test_keepalives_fill_the_silences_and_no_event_is_lost() -> None:
    async def collect() -> list[str]:
        closed: list[bool] = []
        out = [item async for item in with_keepalive(_slow([(0, "a"), (0.35, "b"), (0, "c")], closed), 0.1)]
        assert closed == [True]
        return out

    out = asyncio.run(collect())
    assert [item for item in out if item != KEEPALIVE] == ["a", "b", "c"]
    assert out[0] == "a" and out.count(KEEPALIVE) == 3, out


def test_a_stream_closed_early_closes_its_source() -> None:
    async def close_after_first_keepalive() -> list[bool]:
        closed: list[bool] = []
        stream = with_keepalive(_slow([(0, "a"), (60, "never")], closed), 0.05)
        assert await anext(stream) == "a"
        assert await anext(stream) == KEEPALIVE
        await stream.aclose()  # the client went away
        return closed

    assert asyncio.run(asyncio.wait_for(close_after_first_keepalive(), 5)) == [True]


@pytest.fixture(scope="module")
def quiet_fleet(redis_client: redis.Redis) -> Iterator[FakeFleet]:
    """A fake fleet of its own whose trainer takes no step: a run stays RUNNING, the next one QUEUED."""
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:12]}:"
    fleet = start_fake_fleet(redis_client, prefix)
    fleet.trainer.paused.set()
    yield fleet
    fleet.trainer.paused.clear()
    fleet.stop()
    delete_prefix(redis_client, prefix)


@pytest.fixture(scope="module")
def keepalive_orchestrator(quiet_fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Orchestrator]:
    env = {
        "RLFLEET_ROLLOUT_WATCH_KEEPALIVE_S": str(WATCH_KEEPALIVE_S),
        "RLFLEET_ROLLOUT_GRPC_KEEPALIVE_S": str(GRPC_KEEPALIVE_S),
    }
    orch = start_orchestrator(quiet_fleet, tmp_path_factory.mktemp("logs") / "rollout.log", env=env)
    yield orch
    orch.process.stop(timeout=15)


@pytest.fixture(scope="module")
def queued_run(keepalive_orchestrator: Orchestrator, tokenizer_dir: Path) -> Iterator[str]:
    """A run queued behind one that makes no progress: its watch sees nothing after the first event."""
    url = f"{keepalive_orchestrator.url}/v1/runs"
    ids = [httpx.post(url, json=spec_json(tokenizer_dir, name=n), timeout=10).json()["id"] for n in ("busy", "queued")]
    yield ids[1]
    for run_id in reversed(ids):
        httpx.post(f"{keepalive_orchestrator.url}/v1/runs/{run_id}:cancel", timeout=10)


@pytest.mark.e2e
def test_a_quiet_rest_watch_gets_keepalives_within_a_short_read_timeout(
    keepalive_orchestrator: Orchestrator, queued_run: str
) -> None:
    lines: list[str] = []
    url = f"{keepalive_orchestrator.url}/v1/runs/{queued_run}:watch"
    with httpx.stream("GET", url, timeout=5 * WATCH_KEEPALIVE_S) as response:
        assert response.status_code == 200
        started = time.monotonic()
        for line in response.iter_lines():  # a ReadTimeout here is the bug: a quiet run looked like a lost server
            if line:
                lines.append(line)
            if time.monotonic() - started > 2.0:
                break
    events = [line for line in lines if line.startswith("data:")]
    assert len(events) == 1 and '"RUN_STATE_QUEUED"' in events[0]
    assert lines.count(KEEPALIVE.strip()) >= 4, lines


@pytest.mark.e2e
def test_a_quiet_grpc_watch_survives_the_clients_keepalive_pings(
    keepalive_orchestrator: Orchestrator, queued_run: str
) -> None:
    options = channel_keepalive_options(every_s=1.0)
    events = []
    with grpc.insecure_channel(keepalive_orchestrator.grpc_address, options=options) as channel:
        # Only the deadline may end this watch: gRPC's default server policy ended it with UNAVAILABLE ("too
        # many pings") after the third ping.
        with pytest.raises(grpc.RpcError) as ended:
            for event in RunsStub(channel).Watch(WatchRunRequest(id=queued_run), timeout=5):
                events.append(event)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value.details()
    assert [e.run.id for e in events] == [queued_run]
