"""Submit's request_id (AIP-155) in the transport-free core and the run store, on the real Redis: a repeat
answers the first Submit's run and stores nothing (even while the reward hub is down), another spec under the
request_id is AlreadyExists naming it, concurrent Submits of one request_id (one orchestrator or two) store one
run, validate_only stores nothing, a malformed request_id is InvalidInput naming it, and the request_id's record
expires after 24 h."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format
from rollout_test_support import REDIS_URL, spec_json

from rlfleet.errors import AlreadyExists, InvalidInput
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore
from rlfleet_rollout.submit_requests import REQUEST_ID_RETENTION_S, RequestRecord, SubmitRequest

REQUEST_ID = "3f9c0a1b-7d2e-4c55-9a8b-0e1f2a3b4c5d"


class Hub:
    """The reward hub's /validate as a mock transport: takes every reward while `up`, else refuses connections."""

    def __init__(self) -> None:
        self.up = True
        self.validations = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        self.validations += 1
        return httpx.Response(200, json={"problems": []})


@contextlib.asynccontextmanager
async def cores(prefix: str, hub: Hub, count: int = 1) -> AsyncIterator[list[RunsCore]]:
    """`count` Runs cores, each with a Redis client of its own (as orchestrators sharing one Redis), over `hub`."""
    clients = [aioredis.Redis.from_url(REDIS_URL, socket_timeout=5) for _ in range(count)]
    try:
        async with httpx.AsyncClient(transport=httpx.MockTransport(hub.handle)) as http:
            yield [
                RunsCore(
                    RunStore(client, prefix),
                    RewardClient(http, "http://hub", score_timeout_s=120, validate_timeout_s=0.5),
                    RunNotifier(),
                    RolloutMetrics(),
                    filters=FilterRegistry({}),
                    rollouts=RolloutRegistry.from_entry_points(),
                    poll_interval_s=0.1,
                    run_data_retention_s=60,
                )
                for client in clients
            ]
    finally:
        for client in clients:
            await client.aclose()


def spec_of(tokenizer_dir: Path, **overrides: Any) -> RunSpec:
    return json_format.ParseDict(spec_json(tokenizer_dir, **overrides), RunSpec())


async def stored(core: RunsCore) -> list[Run]:
    return (await core.store.page(page_size=1000))[0]


async def runs_counted(core: RunsCore) -> float:
    """Queued runs on the runs-by-state gauge, counted from the store now (run_counts.py)."""
    assert await core.run_counts.refresh()
    value = core.metrics.registry.get_sample_value("rlfleet_rollout_runs", {"state": "queued"})
    return value or 0.0


def run(scenario: Callable[[], Any]) -> Any:
    return asyncio.run(scenario())


def test_a_repeated_submit_answers_the_first_run_and_stores_nothing_even_with_the_hub_down(
    redis_prefix: str, tokenizer_dir: Path
) -> None:
    hub = Hub()

    async def scenario() -> None:
        async with cores(redis_prefix, hub) as (core,):
            first = await core.submit(spec_of(tokenizer_dir), request_id=REQUEST_ID)
            hub.up = False  # a retry comes when things are shaky: it must not be refused for the hub now
            again = await core.submit(spec_of(tokenizer_dir), request_id=REQUEST_ID)
            assert again == first and first.id
            assert [r.id for r in await stored(core)] == [first.id]
            assert await runs_counted(core) == 1
            # The answer is the run as it is now (AIP-155's stale success response), not a copy of the first one.
            await core.cancel(first.id)
            assert (await core.submit(spec_of(tokenizer_dir), request_id=REQUEST_ID)).state == (
                RunState.RUN_STATE_CANCELLED
            )
            # Without a request_id, or with another one, a Submit makes a run of its own.
            hub.up = True
            other = await core.submit(spec_of(tokenizer_dir), request_id="another-one")
            plain = await core.submit(spec_of(tokenizer_dir))
            assert len({first.id, other.id, plain.id}) == 3
            assert len(await stored(core)) == 3

    run(scenario)


def test_the_request_id_of_a_submit_of_another_spec_is_already_exists_naming_it(
    redis_prefix: str, tokenizer_dir: Path
) -> None:
    async def scenario() -> None:
        async with cores(redis_prefix, Hub()) as (core,):
            first = await core.submit(spec_of(tokenizer_dir), request_id=REQUEST_ID)
            with pytest.raises(AlreadyExists) as refused:
                await core.submit(spec_of(tokenizer_dir, name="other"), request_id=REQUEST_ID)
            assert str(refused.value).startswith(f"request_id: {REQUEST_ID!r} was already used by a Submit of another")
            assert first.id in str(refused.value)
            assert [r.id for r in await stored(core)] == [first.id]
            # The same spec as JSON parsed again, with its fields in another order, is the same spec.
            reordered = json_format.ParseDict(dict(reversed(spec_json(tokenizer_dir).items())), RunSpec())
            assert (await core.submit(reordered, request_id=REQUEST_ID)).id == first.id

    run(scenario)


@pytest.mark.parametrize("orchestrators", [1, 2])
def test_concurrent_submits_of_one_request_id_store_one_run(
    redis_prefix: str, tokenizer_dir: Path, orchestrators: int
) -> None:
    async def scenario() -> None:
        async with cores(redis_prefix, Hub(), orchestrators) as all_cores:
            spec = spec_of(tokenizer_dir)
            answers = await asyncio.gather(
                *(all_cores[i % orchestrators].submit(spec, request_id=REQUEST_ID) for i in range(8))
            )
            assert len({answer.id for answer in answers}) == 1
            assert [r.id for r in await stored(all_cores[0])] == [answers[0].id]
            assert [await runs_counted(core) for core in all_cores] == [1] * orchestrators

    run(scenario)


def test_concurrent_creates_in_the_store_record_one_run_and_its_own_write_is_no_conflict(redis_prefix: str) -> None:
    """Past the core's first look-up, the store's transaction decides: one run stored, the others told whose
    run holds the request_id. A create repeated with the very run it stored (its EXEC went through, its reply was
    lost) is its own write, not an earlier run."""
    request = SubmitRequest(REQUEST_ID, "ab" * 32)

    async def scenario() -> None:
        clients = [aioredis.Redis.from_url(REDIS_URL, socket_timeout=5) for _ in range(4)]
        try:
            stores = [RunStore(client, redis_prefix) for client in clients]
            runs = [Run(id=f"r{i}", state=RunState.RUN_STATE_QUEUED) for i in range(8)]
            answers = await asyncio.gather(*(stores[i % 4].create(r, request) for i, r in enumerate(runs)))
            winners = [r.id for r, answer in zip(runs, answers, strict=True) if answer is None]
            assert len(winners) == 1
            assert {answer for answer in answers if answer is not None} == {RequestRecord(winners[0], "ab" * 32)}
            assert [r.id for r in (await stores[0].page())[0]] == winners
            winner = next(r for r in runs if r.id == winners[0])
            assert await stores[0].create(winner, request) is None
            assert [r.id for r in (await stores[0].page())[0]] == winners
        finally:
            for client in clients:
                await client.aclose()

    run(scenario)


def test_validate_only_with_a_request_id_stores_nothing(redis_prefix: str, tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with cores(redis_prefix, Hub()) as (core,):
            checked = await core.submit(spec_of(tokenizer_dir), validate_only=True, request_id=REQUEST_ID)
            assert checked.id == ""
            assert await stored(core) == []
            assert await core.store.client.exists(core.store.request_key(REQUEST_ID)) == 0
            # So the request_id is still free: the real Submit (even of another spec) makes its run.
            made = await core.submit(spec_of(tokenizer_dir, name="other"), request_id=REQUEST_ID)
            assert made.id and [r.id for r in await stored(core)] == [made.id]
            # And a check with the request_id of a stored run is still only a check.
            again = await core.submit(spec_of(tokenizer_dir), validate_only=True, request_id=REQUEST_ID)
            assert again.id == "" and len(await stored(core)) == 1

    run(scenario)


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        ("x" * 65, "request_id: 65 characters, at most 64 are taken"),
        ("has space", "request_id: 'has space' holds a character other than A-Z a-z 0-9 . _ -"),
        ("a/b", "request_id: 'a/b' holds a character"),
        ("caf\u00e9", "request_id: 'caf\u00e9' holds a character"),
        ("line\nbreak", "request_id: 'line\\nbreak' holds a character"),
    ],
)
def test_a_malformed_request_id_is_invalid_input_naming_it_and_nothing_is_stored(
    redis_prefix: str, tokenizer_dir: Path, request_id: str, message: str
) -> None:
    async def scenario() -> None:
        async with cores(redis_prefix, Hub()) as (core,):
            for validate_only in (False, True):
                with pytest.raises(InvalidInput) as refused:
                    await core.submit(spec_of(tokenizer_dir), validate_only=validate_only, request_id=request_id)
                assert str(refused.value).startswith(message), refused.value
            assert await stored(core) == []
            # The longest taken, of every character taken:
            longest = ("aZ09._-" * 10)[:64]
            assert (await core.submit(spec_of(tokenizer_dir), request_id=longest)).id

    run(scenario)


def test_a_request_id_is_honoured_for_24_hours(redis_prefix: str, tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        async with cores(redis_prefix, Hub()) as (core,):
            await core.submit(spec_of(tokenizer_dir), request_id=REQUEST_ID)
            ttl = await core.store.client.ttl(core.store.request_key(REQUEST_ID))
            assert REQUEST_ID_RETENTION_S == 24 * 3600
            assert REQUEST_ID_RETENTION_S - 60 < ttl <= REQUEST_ID_RETENTION_S

    run(scenario)
