"""The gRPC Runs service over RunsCore; errors become status codes in rlfleet.grpc_errors.ErrorInterceptor.

A request holding a field its message does not have (sent by a client built from a newer runs.proto) is
INVALID_ARGUMENT naming it, as REST refuses an unknown name in a spec or the query: protobuf would drop it, and a
Submit would start a run without the option asked for, a List list every run as if it had filtered.

A Watch the orchestrator's shutdown ends before the run did ends with UNAVAILABLE ("orchestrator shutting down;
watch again"), never OK, which a client's `for event in runs.Watch(...)` loop would take for the run's end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import Message
from grpc import aio

from rlfleet.api_token import ApiTokenGuard
from rlfleet.errors import InvalidInput
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


def require_known_fields(message: Message, path: str = "", *, nested: bool = True) -> None:
    """InvalidInput naming the first field of `message` (at `path`; with `nested`, of the messages it holds too)
    that its message type does not have, by number: the only name it has on the wire."""
    unknown = sorted({field.field_number for field in unknown_fields.UnknownFieldSet(message)})
    if unknown:
        descriptor = message.DESCRIPTOR
        numbers = ", ".join(str(n) for n in unknown)
        known = ", ".join(f"{f.name} = {f.number}" for f in descriptor.fields)
        where = f"{path}: " if path else ""
        raise InvalidInput(
            f"{where}no field numbered {numbers} in {descriptor.full_name} (its fields: {known}); "
            "was the client built from a newer runs.proto? This orchestrator would ignore it: leave it out, or "
            "upgrade the orchestrator"
        )
    if not nested:
        return
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    require_known_fields(item, f"{name}.{key}")
        elif field.is_repeated:
            for i, item in enumerate(value):
                require_known_fields(item, f"{name}[{i}]")
        else:
            require_known_fields(value, name)


class RunsServicer(runs_pb2_grpc.RunsServicer):
    def __init__(self, core: RunsCore) -> None:
        self.core = core

    async def Submit(self, request: SubmitRunRequest, context: aio.ServicerContext) -> Run:  # noqa: N802
        require_known_fields(request, nested=False)
        require_known_fields(request.spec)  # its fields named as REST and the spec's checks name them
        return await self.core.submit(request.spec, validate_only=request.validate_only, request_id=request.request_id)

    async def Get(self, request: GetRunRequest, context: aio.ServicerContext) -> Run:  # noqa: N802
        require_known_fields(request)
        return await self.core.get(request.id)

    async def List(self, request: ListRunsRequest, context: aio.ServicerContext) -> ListRunsResponse:  # noqa: N802
        require_known_fields(request)
        return await self.core.list(request.state, request.page_size, request.page_token)

    async def Cancel(self, request: CancelRunRequest, context: aio.ServicerContext) -> Run:  # noqa: N802
        require_known_fields(request)
        return await self.core.cancel(request.id)

    async def Watch(  # noqa: N802
        self, request: WatchRunRequest, context: aio.ServicerContext
    ) -> AsyncIterator[RunEvent]:
        require_known_fields(request)
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
