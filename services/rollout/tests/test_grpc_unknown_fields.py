"""A gRPC request holding a field its message does not have (a client built from a newer runs.proto) is refused
naming it, as REST refuses an unknown name: protobuf dropped it, so a Submit started a run without the option asked
for and a List listed every run as if it had filtered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.message import Message
from grpc import aio
from trainer_release_support import runs_core

from rlfleet.api_token import ApiTokenGuard
from rlfleet.v1.runs_pb2 import (
    CancelRunRequest,
    GetRunRequest,
    ListRunsRequest,
    ListRunsResponse,
    RolloutSpec,
    Run,
    RunEvent,
    RunSpec,
    RunState,
    SubmitRunRequest,
    WatchRunRequest,
)
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.runs_core import RunsCore

# Field 900 (a number none of the Runs messages uses), a varint 7: its key, 900 << 3, as a varint, then the value.
UNKNOWN_FIELD = bytes([(900 << 3) & 0x7F | 0x80, (900 << 3) >> 7, 7])


def _with_unknown(message: Message) -> bytes:
    return message.SerializeToString() + UNKNOWN_FIELD


@contextlib.asynccontextmanager
async def _channel(core: RunsCore) -> AsyncIterator[aio.Channel]:
    guard = ApiTokenGuard(None, core.metrics.registry, "rollout")
    server, port = build_grpc_server(core, "127.0.0.1", 0, guard, keepalive_s=30)
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(grace=None)


def _raw(channel: aio.Channel, method: str, reply: type[Message]) -> aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        f"/rlfleet.v1.Runs/{method}", request_serializer=lambda raw: raw, response_deserializer=reply.FromString
    )


async def _refusal(call: object) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as refused:
        await call  # type: ignore[misc]
    return refused.value


def test_a_list_filter_this_orchestrator_does_not_know_is_refused_not_ignored(redis_prefix: str) -> None:
    """Before: the List answered every run, the unknown filter dropped."""

    async def scenario() -> aio.AioRpcError:
        async with runs_core(redis_prefix) as core, _channel(core) as channel:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED))
            request = _with_unknown(ListRunsRequest(page_size=10))
            return await _refusal(_raw(channel, "List", ListRunsResponse)(request, timeout=10))

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith(
        "no field numbered 900 in rlfleet.v1.ListRunsRequest (its fields: state = 1, page_size = 2, page_token = 3); "
        "was the sender built from a newer rlfleet/v1/runs.proto?"
    ), error.details()


def test_a_spec_option_this_orchestrator_does_not_know_is_refused_naming_where_it_is(redis_prefix: str) -> None:
    """Before: the option was dropped and the Submit went on (here to the spec's own checks: model.path)."""
    rollout = RolloutSpec.FromString(_with_unknown(RolloutSpec(group_size=4)))
    spec = RunSpec(name="newer-client", rollout=rollout)

    async def scenario() -> tuple[list[aio.AioRpcError], int]:
        async with runs_core(redis_prefix) as core, _channel(core) as channel:
            submit = _raw(channel, "Submit", Run)
            errors = [
                await _refusal(submit(SubmitRunRequest(spec=spec).SerializeToString(), timeout=10)),
                await _refusal(submit(SubmitRunRequest(spec=spec, validate_only=True).SerializeToString(), timeout=10)),
                await _refusal(submit(_with_unknown(SubmitRunRequest(spec=RunSpec(name="x"))), timeout=10)),
            ]
            return errors, len((await core.list(RunState.RUN_STATE_UNSPECIFIED, 0, "")).runs)

    errors, stored = asyncio.run(scenario())
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3, errors
    for error in errors[:2]:
        refusal = error.details() or ""
        assert refusal.startswith("spec.rollout: no field numbered 900 in rlfleet.v1.RolloutSpec (its fields: "), (
            refusal
        )
    assert errors[2].details().startswith("no field numbered 900 in rlfleet.v1.SubmitRunRequest"), errors[2].details()
    assert stored == 0


@pytest.mark.parametrize(
    ("method", "request_", "reply"),
    [
        ("Get", GetRunRequest(id="run-a"), Run),
        ("Cancel", CancelRunRequest(id="run-a"), Run),
        ("Watch", WatchRunRequest(id="run-a"), RunEvent),
    ],
)
def test_every_runs_method_refuses_a_field_it_does_not_know(
    redis_prefix: str, method: str, request_: Message, reply: type[Message]
) -> None:
    async def scenario() -> tuple[aio.AioRpcError, RunState]:
        async with runs_core(redis_prefix) as core, _channel(core) as channel:
            await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_QUEUED))
            raw = _with_unknown(request_)
            if method == "Watch":
                stream = channel.unary_stream(
                    "/rlfleet.v1.Runs/Watch", request_serializer=lambda b: b, response_deserializer=reply.FromString
                )
                error = await _refusal(stream(raw, timeout=10).read())
            else:
                error = await _refusal(_raw(channel, method, reply)(raw, timeout=10))
            return error, (await core.get("run-a")).state

    error, state = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith(f"no field numbered 900 in {request_.DESCRIPTOR.full_name}"), error.details()
    assert state == RunState.RUN_STATE_QUEUED  # a Cancel refused cancels nothing
