"""Bearer-token checking for a gRPC server: metadata `authorization: Bearer <token>`, as an interceptor.

Every method of the server is guarded; a refused call ends with UNAUTHENTICATED before its handler
runs (the request is not even deserialized). Put it first in the server's interceptors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from rlfleet.api_token import ApiTokenGuard
from rlfleet.errors import Unauthenticated


class BearerTokenInterceptor(aio.ServerInterceptor):
    def __init__(self, guard: ApiTokenGuard) -> None:
        self.guard = guard

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not self.guard.enabled:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        try:
            self.guard.check(authorization if isinstance(authorization, str) else None, "grpc")
        except Unauthenticated as exc:
            return _refusal(handler, str(exc))
        return handler


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    async def refuse(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises; the yield makes this an async generator

    # The raw bytes are never parsed: an unauthenticated caller gets no say in what the server decodes.
    kinds = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, refuse),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, refuse_stream),
        "stream_unary": (grpc.stream_unary_rpc_method_handler, refuse),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, refuse_stream),
    }
    for kind, (make, behavior) in kinds.items():
        if getattr(handler, kind) is not None:
            return make(behavior, request_deserializer=None, response_serializer=handler.response_serializer)
    return handler
