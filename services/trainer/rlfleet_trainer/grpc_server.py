"""gRPC `rlfleet.v1.Trainer` over TrainerCore; blocking work runs in threads of its own, errors map once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from grpc import aio

from rlfleet.errors import DeadlineExceeded, InvalidInput
from rlfleet.grpc_errors import ErrorInterceptor
from rlfleet.grpc_limits import message_size_options
from rlfleet.host_port import host_port
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet_trainer.rank_group import RanksBroken
from rlfleet_trainer.trainer_core import START_JOIN_WAIT_S, STOP_WAIT_S, TrainerCore

T = TypeVar("T")

# A call that waits (StopRun for the step in progress, Checkpoint for the next step boundary, StartRun for
# the same run's start) answers this long before its caller's deadline when the wait has not ended by then,
# so the caller hears "ask again" from the trainer, and no handler thread waits on for a caller that has left.
_ANSWER_MARGIN_S = 1.0
NO_DEADLINE_WAIT_S = 60.0
"""How long a call without a deadline waits (grpcurl, a script): such a caller may have gone long ago, and a few of
them waiting out StopRun's 300 s or --checkpoint-timeout-s would hold handler threads all that time."""
HANDLER_THREADS = 32
"""Threads for the calls that block (StartRun, StopRun, Checkpoint, a WatchSteps poll), this servicer's own, not
asyncio's default pool (cpus + 4: 6 on two cores, which a handful of waiting calls took). The orchestrator needs two
or three at once; the rest is room for other callers, each bounded by its deadline or NO_DEADLINE_WAIT_S. Should
they all be busy, StopRun and Checkpoint are recorded before a call waits for a thread, and answered in time."""


def _wait_s(context: aio.ServicerContext, bound_s: float) -> float:
    """How long a handler may wait: `bound_s`, cut to end `_ANSWER_MARGIN_S` before the caller's deadline, or to
    NO_DEADLINE_WAIT_S for a caller without one."""
    remaining = context.time_remaining()
    if remaining is None:
        return min(bound_s, NO_DEADLINE_WAIT_S)
    return min(bound_s, max(0.0, remaining - _ANSWER_MARGIN_S))


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, core: TrainerCore) -> None:
        self.core = core
        self._threads = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="trainer-rpc")

    def _unless_broken(self) -> None:
        """Once the ranks are broken no answer about a run holds: this trainer is ending, and the restarted one resumes
        its runs from their checkpoints. UNAVAILABLE naming why, which the orchestrator asks again after, rather than
        the run's FAILED status (final to it) or a Conflict from a call the break cut short."""
        why = self.core.ranks.broken
        if why is not None:
            raise RanksBroken(why)

    async def _answer(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`'s answer, unless the ranks broke before or while it ran."""
        self._unless_broken()
        try:
            result = await call()
        except Exception:
            self._unless_broken()
            raise
        self._unless_broken()
        return result

    async def _in_thread(self, call: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, call, *args)

    async def _within(self, wait_s: float, late: str, call: Callable[..., T], *args: object) -> T:
        """`call(*args)` in a handler thread, which itself waits at most `wait_s`; DeadlineExceeded (`late`) when no
        answer came shortly after that (every thread was busy, and the call waited for one)."""
        try:
            return await asyncio.wait_for(self._in_thread(call, *args), wait_s + _ANSWER_MARGIN_S / 2)
        except TimeoutError:
            raise DeadlineExceeded(late) from None

    async def StartRun(
        self, request: trainer_pb2.StartRunRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:  # noqa: N802,E501
        # Refused for what is missing, not for the first empty field of an empty spec (model.path).
        if not request.HasField("spec"):
            raise InvalidInput("spec must be set: the run's RunSpec (model, dataset, rollout, reward, ...)")
        join_wait = _wait_s(context, START_JOIN_WAIT_S)
        # Not cut short: a start goes on after its caller stops waiting (asking again joins it).
        return await self._answer(lambda: self._in_thread(self.core.start_run, request.run_id, request.spec, join_wait))

    async def Status(
        self, request: trainer_pb2.StatusRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:  # noqa: N802,E501
        # Without a run id: the run this trainer is busy with, if any (who else would need stopping).
        self._unless_broken()
        return self.core.status(request.run_id) if request.run_id else self.core.held()

    async def Checkpoint(
        self, request: trainer_pb2.CheckpointRequest, context: aio.ServicerContext
    ) -> trainer_pb2.CheckpointResponse:  # noqa: N802,E501
        wait = _wait_s(context, self.core.settings.checkpoint_timeout_s)
        self.core.request_checkpoint(request.run_id)  # taken at the next step boundary whatever this call hears
        late = (
            f"run {request.run_id}: no checkpoint within {wait:.0f}s; it is taken after the step in progress: ask again"
        )
        return await self._answer(lambda: self._within(wait, late, self.core.checkpoint, request.run_id, wait))

    async def StopRun(
        self, request: trainer_pb2.StopRunRequest, context: aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:  # noqa: N802,E501
        wait = _wait_s(context, STOP_WAIT_S)
        self.core.request_stop(request.run_id, request.checkpoint)  # the stop stands whatever this call hears
        late = f"run {request.run_id} has not stopped within {wait:.0f}s; it stops after its step: ask again"
        return await self._answer(
            lambda: self._within(wait, late, self.core.stop_run, request.run_id, request.checkpoint, wait)
        )

    async def WatchSteps(
        self, request: trainer_pb2.WatchStepsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.StepReport]:  # noqa: N802,E501
        if request.from_step < 0:
            raise InvalidInput(f"from_step: must be >= 0 (0 starts with the next step), got {request.from_step}")
        # 0: the step after the run's current one, or, while the run starts, the first step it takes once loaded.
        first_step = None if request.from_step else self.core.first_step_to_watch(request.run_id)
        next_step = request.from_step
        while True:
            if first_step is not None and (step := first_step()) is not None:
                next_step, first_step = step, None
            if first_step is None:
                reports, finished = self.core.reports(request.run_id, next_step)
                for report in reports:
                    yield report
                    next_step = report.step + 1
                if finished and not reports:
                    return
            with contextlib.suppress(TimeoutError):  # every thread busy: poll again rather than wait for one
                await asyncio.wait_for(self._in_thread(self.core.wait_for_change, request.run_id, 1.0), 2.0)


def make_grpc_server(core: TrainerCore, host: str, port: int) -> aio.Server:
    server = aio.server(interceptors=[ErrorInterceptor()], options=message_size_options())
    trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(core), server)
    address = host_port(host, port)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind the trainer's gRPC server to {address}")
    return server
