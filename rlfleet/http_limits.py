"""A bound on request bodies for a FastAPI app: larger ones get 413 before the app buffers them.

The same bound as the gRPC face of the API (`rlfleet.grpc_limits`), so neither transport accepts what
the other refuses. A declared Content-Length over the bound is refused at once; a body without one
(chunked) is counted as it arrives, and reading past the bound raises ResourceExhausted inside the app,
whose error handlers (`rlfleet.http_errors`) answer it.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlfleet.errors import ResourceExhausted
from rlfleet.grpc_limits import MAX_MESSAGE_BYTES
from rlfleet.http_errors import error_response


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, counting_receive, send)

    def _error(self) -> ResourceExhausted:
        return ResourceExhausted(f"request body over {self.max_bytes} bytes; send less")


def limit_request_body(app: FastAPI, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_bytes)
