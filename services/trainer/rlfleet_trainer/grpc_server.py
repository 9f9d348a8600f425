"""gRPC `rlfleet.v1.Trainer` over TrainerCore; blocking work runs in threads, errors map once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from grpc import aio

from rlfleet.grpc_errors import ErrorInterceptor
from rlfleet.grpc_limits import message_size_options
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet_trainer.trainer_core import START_JOIN_WAIT_S, STOP_WAIT_S, TrainerCore

# A call that waits (StopRun for the step in progress, Checkpoint for the next step boundary, StartRun for
# the same run's start) answers this long before its caller's deadline when the wait has not ended by then,
# so the caller hears "ask again" from the trainer, and no handler thread waits on for a caller that has
# left (a few such threads would take every worker asyncio.to_thread has).
_ANSWER_MARGIN_S = 1.0


def _wait_s(context: aio.ServicerContext, bound_s: float) -> float:
    """How long a handler may wait: `bound_s`, cut to end `_ANSWER_MARGIN_S` before the caller's deadline."""
    remaining = context.time_remaining()
    return bound_s if remaining is None else min(bound_s, max(0.0, remaining - _ANSWER_MARGIN_S))


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, core: TrainerCore) -> None:
        self.core = core

    async def StartRun(
        self, request: trainer_pb2.StartRunRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:  # noqa: N802,E501
        join_wait = _wait_s(context, START_JOIN_WAIT_S)
        return await asyncio.to_thread(self.core.start_run, request.run_id, request.spec, join_wait)

    async def Status(
        self, request: trainer_pb2.StatusRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:  # noqa: N802,E501
        # Without a run id: the run this trainer is busy with, if any (who else would need stopping).
        return self.core.status(request.run_id) if request.run_id else self.core.held()

    async def Checkpoint(
        self, request: trainer_pb2.CheckpointRequest, context: aio.ServicerContext
    ) -> trainer_pb2.CheckpointResponse:  # noqa: N802,E501
        wait = _wait_s(context, self.core.settings.checkpoint_timeout_s)
        return await asyncio.to_thread(self.core.checkpoint, request.run_id, wait)

    async def StopRun(
        self, request: trainer_pb2.StopRunRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:  # noqa: N802,E501
        wait = _wait_s(context, STOP_WAIT_S)
        return await asyncio.to_thread(self.core.stop_run, request.run_id, request.checkpoint, wait)

    async def WatchSteps(
        self, request: trainer_pb2.WatchStepsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.StepReport]:  # noqa: N802,E501
        next_step = request.from_step or self.core.status(request.run_id).step + 1
        while True:
            reports, finished = self.core.reports(request.run_id, next_step)
            for report in reports:
                yield report
                next_step = report.step + 1
            if finished and not reports:
                return
            await asyncio.to_thread(self.core.wait_for_change, request.run_id, 1.0)


def make_grpc_server(core: TrainerCore, host: str, port: int) -> aio.Server:
    server = aio.server(interceptors=[ErrorInterceptor()], options=message_size_options())
    trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(core), server)
    server.add_insecure_port(f"{host}:{port}")
    return server
