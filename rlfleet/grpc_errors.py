"""Maps rlfleet errors to gRPC status codes, once, as a server interceptor.

Handlers raise `RlfleetError`s; the interceptor aborts the call with the matching code and the
error's message. Anything else becomes INTERNAL with a generic message (details go to the log).
Requests are decoded here too, so bytes that are not the method's message are INVALID_ARGUMENT
(gRPC itself would answer UNKNOWN with the exception's class name); no handler sees such a request, so a
service that counts its refusals is told of it through `on_malformed`. So is a request holding a field its
message does not have (`rlfleet.unknown_fields`: sent from a newer .proto, it would be read without it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from rlfleet.errors import InvalidInput, RlfleetError
from rlfleet.unknown_fields import require_known_fields

logger = logging.getLogger(__name__)


# The most of a message a status carries, in UTF-8 bytes. It travels in a trailer (grpc-message, percent-encoded:
# a non-ASCII byte takes three), and a client refuses trailers past 8 KiB whole: a message quoting an oversized
# input (a 100,000-character run id) reached the caller as RESOURCE_EXHAUSTED instead of its own code.
MAX_DETAILS_BYTES = 1500


def status_code(error: RlfleetError) -> grpc.StatusCode:
    return grpc.StatusCode[error.grpc_code]


def details(message: str) -> str:
    """`message`, cut to MAX_DETAILS_BYTES with the length it had said, so the status reaches the caller."""
    encoded = message.encode()
    if len(encoded) <= MAX_DETAILS_BYTES:
        return message
    shown = encoded[:MAX_DETAILS_BYTES].decode(errors="ignore")
    return f"{shown}... ({len(message)} characters)"


async def _abort(context: aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, RlfleetError):
        if exc.http_status >= 500:
            logger.error("%s failed: %s", method, exc)
        await context.abort(status_code(exc), details(str(exc)))
    logger.exception("%s failed", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the service log")


Deserializer = Callable[[bytes], Any] | None
Decoder = Callable[[Any], Any]


def _decoder(deserializer: Deserializer, method: str, on_malformed: Callable[[str], None] | None) -> Decoder:
    def decode(raw: Any) -> Any:
        if deserializer is None:
            return raw
        try:
            request = deserializer(raw)
            require_known_fields(request)
        except DecodeError as exc:
            if on_malformed is not None:
                on_malformed(method)
            raise InvalidInput(f"malformed request: {exc}") from None
        except InvalidInput:
            if on_malformed is not None:
                on_malformed(method)
            raise
        return request

    return decode


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], decode: Decoder, method: str) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: aio.ServicerContext) -> Any:
        try:
            return await behavior(decode(request), context)
        except aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code right here
            await _abort(context, exc, method)

    return handler


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], decode: Decoder, method: str
) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(decode(request), context):
                yield item
        except aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code right here
            await _abort(context, exc, method)

    return handler


class ErrorInterceptor(aio.ServerInterceptor):
    """Turns exceptions raised by unary-unary and unary-stream handlers into gRPC statuses.

    `on_malformed`, if given, is called with the method's full name (`/rlfleet.v1.Reward/Score`) for each
    request refused as malformed.
    """

    def __init__(self, on_malformed: Callable[[str], None] | None = None) -> None:
        self._on_malformed = on_malformed

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        decode = _decoder(handler.request_deserializer, method, self._on_malformed)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, decode, method),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, decode, method),
                response_serializer=handler.response_serializer,
            )
        return handler
