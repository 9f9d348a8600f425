"""Every gRPC service refuses a request holding a field its message does not have (rlfleet.unknown_fields, checked
as ErrorInterceptor decodes requests): protobuf dropped it, so a service read the request without it. The Runs
service's methods are covered end to end in services/rollout/tests/test_grpc_unknown_fields.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf.message import Message
from grpc import aio

from rlfleet.errors import InvalidInput
from rlfleet.grpc_errors import ErrorInterceptor
from rlfleet.unknown_fields import require_known_fields
from rlfleet.v1 import reward_pb2, reward_pb2_grpc
from rlfleet.v1.runs_pb2 import RolloutSpec, RunSpec
from rlfleet.v1.trainer_pb2 import StartRunRequest

# Field 900 (a number none of the messages uses) holding the varint 7: its key, 900 << 3, as a varint, then 7.
UNKNOWN_FIELD = bytes([(900 << 3) & 0x7F | 0x80, (900 << 3) >> 7, 7])


def newer(message: Message) -> Message:
    """`message` as this process reads it from a sender whose .proto gives it field 900."""
    return type(message).FromString(message.SerializeToString() + UNKNOWN_FIELD)


def test_a_run_spec_option_the_trainer_does_not_know_is_named_where_it_is() -> None:
    """A StartRun from a newer orchestrator: the trainer would train the run without the setting."""
    request = StartRunRequest(run_id="r", spec=RunSpec(name="n", rollout=newer(RolloutSpec(group_size=4))))
    with pytest.raises(InvalidInput) as refused:
        require_known_fields(StartRunRequest.FromString(request.SerializeToString()))
    assert str(refused.value).startswith(
        "spec.rollout: no field numbered 900 in rlfleet.v1.RolloutSpec (its fields: "
    ), refused.value
    assert "newer rlfleet/v1/runs.proto?" in str(refused.value)


def test_a_score_item_field_the_hub_does_not_know_is_named_by_its_index() -> None:
    request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=str(i)) for i in range(3)])
    request.items[2].CopyFrom(newer(request.items[2]))
    with pytest.raises(InvalidInput, match=r"^items\[2\]: no field numbered 900 in rlfleet.v1.ScoreItem"):
        require_known_fields(request)


def test_known_fields_at_every_depth_pass_and_a_large_request_is_checked_quickly() -> None:
    items = [reward_pb2.ScoreItem(id=str(i), response="x" * 100, metadata={"a": "b", "c": "d"}) for i in range(8192)]
    request = reward_pb2.ScoreRequest(spec=reward_pb2.RewardSpec(timeout_seconds=3), items=items)
    started = time.monotonic()
    require_known_fields(reward_pb2.ScoreRequest.FromString(request.SerializeToString()))
    assert time.monotonic() - started < 1.0, "a bound far above what 8192 items take (a few ms)"


class _Hub(reward_pb2_grpc.RewardServicer):
    def __init__(self) -> None:
        self.scored = 0

    async def Score(self, request: reward_pb2.ScoreRequest, context: aio.ServicerContext) -> reward_pb2.ScoreResponse:  # noqa: N802
        self.scored += 1
        return reward_pb2.ScoreResponse()


def test_the_interceptor_refuses_the_request_before_any_handler_and_counts_it() -> None:
    refused_methods: list[str] = []

    async def scenario() -> tuple[grpc.StatusCode, str, int]:
        hub = _Hub()
        server = aio.server(interceptors=[ErrorInterceptor(on_malformed=refused_methods.append)])
        reward_pb2_grpc.add_RewardServicer_to_server(hub, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                score = channel.unary_unary(
                    "/rlfleet.v1.Reward/Score",
                    request_serializer=lambda raw: raw,
                    response_deserializer=reward_pb2.ScoreResponse.FromString,
                )
                await score(reward_pb2.ScoreRequest().SerializeToString(), timeout=10)  # known fields: served
                with pytest.raises(aio.AioRpcError) as refused:
                    await score(reward_pb2.ScoreRequest().SerializeToString() + UNKNOWN_FIELD, timeout=10)
        finally:
            await server.stop(grace=None)
        return refused.value.code(), refused.value.details() or "", hub.scored

    code, details, scored = asyncio.run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("no field numbered 900 in rlfleet.v1.ScoreRequest"), details
    assert scored == 1, "the handler saw only the request it could read whole"
    assert refused_methods == ["/rlfleet.v1.Reward/Score"]
