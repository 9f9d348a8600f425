"""The gRPC Runs service over RunsCore; errors become status codes in rlfleet.grpc_errors.ErrorInterceptor.

A Watch the orchestrator's shutdown ends before the run did ends with UNAVAILABLE ("orchestrator shutting down;
watch again"), never OK, which a client's `for event in runs.Watch(...)` loop would take for the run's end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc import aio

from rlfleet.api_token import ApiTokenGuard
from rlfleet.grpc_auth import BearerTokenInterceptor
from rlfleet.grpc_errors import ErrorInterceptor
from rlfleet.grpc_keepalive import server_keepalive_options
from rlfleet.grpc_limits import message_size_options
from rlfleet.host_port import host_port
from rlfleet.v1 import runs_pb2_grpc
from rlfleet.v1.runs_pb2 import (
    CancelRunRequest,
    GetRunRequest,
    ListRunsRequest,
    ListRunsResponse,
    Run,
    RunEvent,
    SubmitRunRequest,
    WatchRunRequest,
)
from rlfleet_rollout.runs_core import RunsCore, ShuttingDown


class RunsServicer(runs_pb2_grpc.RunsServicer):
    def __init__(self, core: RunsCore) -> None:
        self.core = core

    async def Submit(self, request: SubmitRunRequest, context: aio.ServicerContext) -> Run:  # noqa: N802
        return await self.core.submit(request.spec, validate_only=request.validate_only, request_id=request.request_id)

    async def Get(self, request: GetRunRequest, context: aio.ServicerContext) -> Run:  # noqa: N802
        return await self.core.get(request.id)

    async def List(self, request: ListRunsRequest, context: aio.ServicerContext) -> ListRunsResponse:  # noqa: N802
        return await self.core.list(request.state, request.page_size, request.page_token)

    async def Cancel(self, request: CancelRunRequest, context: aio.ServicerContext) -> Run:  # noqa: N802
        return await self.core.cancel(request.id)

    async def Watch(  # noqa: N802
        self, request: WatchRunRequest, context: aio.ServicerContext
    ) -> AsyncIterator[RunEvent]:
        try:
            async for event in self.core.watch(request.id):
                yield event
        except ShuttingDown as exc:
            # Answered here, not by the interceptor, which would log each open watch as an error of the service.
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


def build_grpc_server(
    core: RunsCore, host: str, port: int, guard: ApiTokenGuard, *, keepalive_s: float
) -> tuple[aio.Server, int]:
    """The server (not started) and the port it bound (useful when `port` is 0). Watch streams stay open
    while a run is quiet: see rlfleet.grpc_keepalive."""
    server = aio.server(
        interceptors=[BearerTokenInterceptor(guard), ErrorInterceptor()],
        options=message_size_options() + server_keepalive_options(keepalive_s),
    )
    runs_pb2_grpc.add_RunsServicer_to_server(RunsServicer(core), server)
    address = host_port(host, port)
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    return server, bound
