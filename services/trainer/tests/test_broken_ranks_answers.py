"""Once the ranks are broken the trainer is ending (its runs resume in the restarted one), so no call answers with a
run's state: a run marked FAILED by the break, or a Conflict from a call the break cut short, would be final to the
orchestrator. Every call answers UNAVAILABLE naming why, which the orchestrator asks again after."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlfleet.processes import free_port
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import CheckpointRequest, StatusRequest, StopRunRequest
from rlfleet_trainer.grpc_server import make_grpc_server
from rlfleet_trainer.trainer_core import TrainerCore


def test_every_call_answers_unavailable_naming_why_once_the_ranks_broke(core: TrainerCore) -> None:
    core.ranks._break("op 'train_step' on rank 1", TimeoutError("timed out after 10s"))
    port = free_port()

    async def ask() -> list[grpc.aio.AioRpcError]:
        server = make_grpc_server(core, "127.0.0.1", port)
        await server.start()
        errors = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                for call in (
                    stub.Status(StatusRequest(), timeout=10),
                    stub.Status(StatusRequest(run_id="a"), timeout=10),
                    stub.Checkpoint(CheckpointRequest(run_id="a"), timeout=10),
                    stub.StopRun(StopRunRequest(run_id="a"), timeout=10),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call
                    errors.append(caught.value)
        finally:
            await server.stop(grace=None)
        return errors

    for error in asyncio.run(ask()):
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "the trainer's ranks are out of step: op 'train_step' on rank 1" in (error.details() or "")
