"""List's page tokens over REST and gRPC alike: opaque, and paging on only the listing they came from. A token was
the creation number of a page's last run, taken by a List of any state: a RUNNING listing's token sent with
`state=QUEUED` silently left out every queued run before it, and any number a client made up was taken."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import httpx
from grpc import aio
from prometheus_client import CollectorRegistry
from trainer_release_support import runs_core

from rlfleet.api_token import ApiTokenGuard
from rlfleet.v1.runs_pb2 import ListRunsRequest, Run, RunState
from rlfleet.v1.runs_pb2_grpc import RunsStub
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.http_app import build_app
from rlfleet_rollout.runs_core import RunsCore

QUEUED, RUNNING = RunState.RUN_STATE_QUEUED, RunState.RUN_STATE_RUNNING


@contextlib.asynccontextmanager
async def _both(core: RunsCore) -> AsyncIterator[tuple[RunsStub, httpx.AsyncClient]]:
    """A gRPC client and a REST client of the Runs API over `core`."""
    server, port = build_grpc_server(
        core, "127.0.0.1", 0, ApiTokenGuard(None, core.metrics.registry, "rollout"), keepalive_s=30
    )
    await server.start()
    app = build_app(
        core, core.metrics, core.store.client, ApiTokenGuard(None, CollectorRegistry(), "rollout"), watch_keepalive_s=15
    )
    try:
        async with (
            aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rest") as rest,
        ):
            yield RunsStub(channel), rest
    finally:
        await server.stop(grace=None)


async def _create(core: RunsCore, *runs: tuple[str, RunState]) -> None:
    for run_id, state in runs:
        await core.store.create(Run(id=run_id, state=state))


def test_a_token_sent_with_another_state_filter_is_refused_on_both_transports(redis_prefix: str) -> None:
    """Before: the RUNNING listing's token, sent with state=QUEUED, answered [q2, q3]: q1 left out, no error."""

    async def scenario() -> tuple[str, aio.AioRpcError, httpx.Response, aio.AioRpcError]:
        async with runs_core(redis_prefix) as core, _both(core) as (runs, rest):
            await _create(core, ("q1", QUEUED), ("r1", RUNNING), ("q2", QUEUED), ("r2", RUNNING), ("q3", QUEUED))
            first = await runs.List(ListRunsRequest(state=RUNNING, page_size=1), timeout=10)
            assert [r.id for r in first.runs] == ["r1"]
            token = first.next_page_token
            refused = await _refusal(runs.List(ListRunsRequest(state=QUEUED, page_token=token), timeout=10))
            answer = await rest.get("/v1/runs", params={"state": "queued", "page_token": token})
            everything = await _refusal(runs.List(ListRunsRequest(page_token=token), timeout=10))
            return token, refused, answer, everything

    token, refused, answer, everything = asyncio.run(scenario())
    message = (
        "page_token: it pages on a List of the RUNNING runs, not of the QUEUED runs: a token pages on only the "
        "listing it came from (page_size may change); to list the QUEUED runs, start again without a page_token"
    )
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details() == message
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {"kind": "invalid_input", "message": message, "code": 400}
    assert everything.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not of every run" in everything.details()


def test_a_token_list_did_not_return_is_refused(redis_prefix: str) -> None:
    """Before: a made-up creation number ("0", "3") was taken as a place to list from."""

    async def scenario() -> tuple[list[aio.AioRpcError], list[httpx.Response]]:
        async with runs_core(redis_prefix) as core, _both(core) as (runs, rest):
            await _create(core, ("q1", QUEUED), ("q2", QUEUED))
            made_up = ["0", "3", "cDE6UVVFVUVEOmFiYw", "cDI6UVVFVUVEOjE", "x" * 65, "a b"]
            errors = [await _refusal(runs.List(ListRunsRequest(page_token=t), timeout=10)) for t in made_up]
            answers = [await rest.get("/v1/runs", params={"page_token": t}) for t in made_up]
            return errors, answers

    errors, answers = asyncio.run(scenario())
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details().startswith("page_token: ") and "is not a token returned by List" in error.details()
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert "is not a token returned by List" in answer.json()["error"]["message"]


def test_paging_while_runs_are_created_lists_each_run_once_in_order(redis_prefix: str) -> None:
    """A run created during the paging comes after the pages already read; none is missed or listed twice, and a
    token changes page_size freely (AIP-158)."""

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        async with runs_core(redis_prefix) as core, _both(core) as (runs, rest):
            await _create(core, *((f"run-{i}", QUEUED if i % 2 else RUNNING) for i in range(5)))
            seen, tokens, token, created = [], [], "", 5
            for size in (1, 2, 1, 3, 1, 2, 1, 1, 1, 1):
                page = await runs.List(ListRunsRequest(page_size=size, page_token=token), timeout=10)
                seen += [r.id for r in page.runs]
                token = page.next_page_token
                tokens.append(token)
                if created < 9:
                    await _create(core, (f"run-{created}", QUEUED))
                    created += 1
                if not token:
                    break
            queued, token = [], ""
            while True:
                body = (
                    await rest.get("/v1/runs", params={"state": "QUEUED", "page_size": 2, "page_token": token})
                ).json()
                queued += [r["id"] for r in body["runs"]]
                if not (token := body["next_page_token"]):
                    break
            return seen, [t for t in tokens if t], queued

    seen, tokens, queued = asyncio.run(scenario())
    assert seen == [f"run-{i}" for i in range(9)]
    assert queued == [f"run-{i}" for i in (1, 3, 5, 6, 7, 8)]
    assert not any(t.isdigit() for t in tokens), tokens  # not a run's position a client could take or make up


async def _refusal(call: object) -> aio.AioRpcError:
    try:
        await call  # type: ignore[misc]
    except aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call was answered, not refused")
