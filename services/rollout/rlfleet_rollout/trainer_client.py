"""Client of the trainer's gRPC service, with its status codes turned into rlfleet errors.

The run loop decides what each error means for the run: Unavailable and DeadlineExceeded are
waited out within the step bound, NotFound means the trainer restarted and needs StartRun again,
Conflict from StartRun that the trainer holds another run (trainer_release.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc import aio

from rlfleet.errors import Conflict, DeadlineExceeded, Internal, InvalidInput, NotFound, RlfleetError, Unavailable
from rlfleet.grpc_limits import message_size_options
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import (
    StartRunRequest,
    StatusRequest,
    StepReport,
    StopRunRequest,
    TrainerStatus,
    WatchStepsRequest,
)
from rlfleet.v1.trainer_pb2_grpc import TrainerStub

_ERRORS: dict[grpc.StatusCode, type[RlfleetError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
}


# How soon the channel tries the trainer again after losing it (a restarted trainer). With gRPC's
# defaults (1 s, growing x1.6 up to 120 s) calls fail fast with UNAVAILABLE meanwhile, so a trainer
# back after a restart went unnoticed for 11 s and more; these bound the wait to 2 s. Keepalive
# pings are not set: the trainer's server accepts one at most every 5 minutes (gRPC's default) and
# answers faster ones with GOAWAY; every call has a deadline instead.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def to_rlfleet_error(exc: aio.AioRpcError, call: str) -> RlfleetError:
    kind = _ERRORS.get(exc.code(), Internal)
    return kind(f"trainer {call} failed: {exc.code().name}: {exc.details()}")


class TrainerClient:
    def __init__(self, address: str, *, call_timeout_s: float, start_timeout_s: float) -> None:
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self._channel = aio.insecure_channel(address, options=[*message_size_options(), *CHANNEL_OPTIONS])
        self._stub = TrainerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def start_run(self, run_id: str, spec: RunSpec) -> TrainerStatus:
        try:
            return await self._stub.StartRun(StartRunRequest(run_id=run_id, spec=spec), timeout=self.start_timeout_s)
        except aio.AioRpcError as exc:
            raise to_rlfleet_error(exc, "StartRun") from exc

    async def status(self, run_id: str) -> TrainerStatus:
        try:
            return await self._stub.Status(StatusRequest(run_id=run_id), timeout=self.call_timeout_s)
        except aio.AioRpcError as exc:
            raise to_rlfleet_error(exc, "Status") from exc

    async def held(self) -> TrainerStatus:
        """The run the trainer is busy with (Status without a run id); state IDLE and no run id when none."""
        try:
            return await self._stub.Status(StatusRequest(), timeout=self.call_timeout_s)
        except aio.AioRpcError as exc:
            raise to_rlfleet_error(exc, "Status") from exc

    async def stop_run(self, run_id: str) -> TrainerStatus:
        """The run's final status once the trainer has stopped it; DeadlineExceeded while it is still
        finishing its step (the stop stands: ask again), NotFound from a trainer that never had it."""
        try:
            return await self._stub.StopRun(StopRunRequest(run_id=run_id), timeout=self.call_timeout_s)
        except aio.AioRpcError as exc:
            raise to_rlfleet_error(exc, "StopRun") from exc

    async def watch_steps(self, run_id: str, from_step: int) -> AsyncIterator[StepReport]:
        """Step reports as the trainer makes them; the stream lives as long as the run (no deadline)."""
        call = self._stub.WatchSteps(WatchStepsRequest(run_id=run_id, from_step=from_step))
        try:
            async for report in call:
                yield report
        except aio.AioRpcError as exc:
            raise to_rlfleet_error(exc, "WatchSteps") from exc
        finally:
            call.cancel()
