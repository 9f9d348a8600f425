"""The generation routes' fast path: a bare ASGI layer in front of the FastAPI app.

Every generation request goes through here without FastAPI's routing, dependency solving and
middleware stack, which together cost about as much router CPU as the routing itself. It answers
errors in the same body shape as the app (`rlfleet.http_errors`) and counts each request in the
same metrics as `RequestMetricsMiddleware`; every other request goes on to the app.
"""

from __future__ import annotations

import logging
import time

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlfleet.errors import Internal, RlfleetError
from rlfleet.http_errors import error_response
from rlfleet_router.fleet import Fleet
from rlfleet_router.openai_routing import GENERATION_ROUTES

logger = logging.getLogger(__name__)
# Counted (as nginx does) for a client that closed its connection before its request was whole.
CLIENT_CLOSED_REQUEST = 499


class GenerationRelay:
    def __init__(self, app: ASGIApp, fleet: Fleet) -> None:
        self.app = app
        self.fleet = fleet
        self.routes = frozenset(GENERATION_ROUTES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.routes:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        route = scope["path"]
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            try:
                body = await read_body(receive)
            except RlfleetError as exc:  # a body over the router's size bound, counted as it arrived
                await error_response(exc)(scope, receive, send_and_watch)
                return
            if body is None:
                status = CLIENT_CLOSED_REQUEST
                return
            response: Response
            try:
                response = await self.fleet.generate(route, body, Headers(scope=scope), arrived_at=time.perf_counter())
            except RlfleetError as exc:
                if exc.http_status >= 500:
                    logger.error("POST %s failed: %s", route, exc)
                response = error_response(exc)
            except Exception:
                logger.exception("POST %s failed", route)
                response = error_response(Internal("internal error; see the service log"))
            await response(scope, receive, send_and_watch)
        finally:
            self.fleet.metrics.observe_request(route, status, time.perf_counter() - started)


async def read_body(receive: Receive) -> bytes | None:
    """The request body; None if the client went away before sending all of it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
