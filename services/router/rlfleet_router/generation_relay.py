"""The generation routes' fast path: a bare ASGI layer in front of the FastAPI app.

Every generation request goes through here without FastAPI's routing, dependency solving and
middleware stack (body bound included), which together cost about as much router CPU as the routing
itself. It bounds the body itself, answers errors in the same body shape as the app
(`rlfleet.http_errors`), gives a request up when its client leaves, and counts each request in the same
metrics as `RequestMetricsMiddleware` (an answer cut short at its error's status, a client gone as 499);
every other request goes on to the app. A generation path asked with a method it does not take is
answered 405 here, as the app has no route for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlfleet.errors import DeadlineExceeded, Internal, MethodNotAllowed, ResourceExhausted, RlfleetError
from rlfleet_router.config import RouterConfig
from rlfleet_router.engine_attempts import ClientGone
from rlfleet_router.fleet import Fleet
from rlfleet_router.metrics import GENERATION_ROUTES
from rlfleet_router.openai_errors import route_error_response
from rlfleet_router.workers import NoHealthyEngine

logger = logging.getLogger(__name__)
# Counted (as nginx does) for a client that closed its connection before its request was whole.
CLIENT_CLOSED_REQUEST = 499
# The methods each generation path takes, as SGLang's: /generate also PUT, which reaches the engine as a POST.
GENERATION_METHODS = {route: ("POST", "PUT") if route == "/generate" else ("POST",) for route in GENERATION_ROUTES}


class GenerationRelay:
    def __init__(self, app: ASGIApp, fleet: Fleet, max_bytes: int) -> None:
        self.app = app
        self.fleet = fleet
        self.max_bytes = max_bytes
        self.methods = GENERATION_METHODS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.methods:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        deadline = time.monotonic() + self.fleet.config.request_timeout_secs
        route = scope["path"]
        status: int | None = None  # until the answer starts
        complete = False  # once its last piece is sent

        async def send_and_watch(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = int(message["status"])
            # Bounded on this path (the rare one) for every piece: uvicorn waits for a client that stops reading.
            await within_deadline(send(message), deadline, route)
            complete = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            allowed = self.methods[route]
            if scope["method"] not in allowed:
                await method_not_allowed(scope["method"], route, allowed)(scope, receive, send_and_watch)
                return
            headers = header_dict(scope["headers"])
            try:
                body = await read_body(receive, headers.get("content-length"), self.max_bytes)
            except RlfleetError as exc:  # a body over the router's size bound, refused as it arrived
                await route_error_response(route, exc)(scope, receive, send_and_watch)
                return
            if body is None:
                status = CLIENT_CLOSED_REQUEST
                return
            # On this path (the rare one: pipelined requests, Expect: 100-continue) a task watches for the
            # client's disconnect; the parser's path learns of it from the protocol without one.
            gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            watcher = asyncio.create_task(watch_disconnect(receive, gone))
            try:
                await self.answer(route, body, headers, scope, receive, send_and_watch, gone)
            finally:
                watcher.cancel()
            if gone.done() and not complete:  # before the answer or during it, as on the parser's path
                status = CLIENT_CLOSED_REQUEST
        except RlfleetError as exc:  # the engine's answer cut short after its head was sent
            status = exc.http_status
            raise
        finally:
            self.fleet.metrics.observe_request(route, 500 if status is None else status, time.perf_counter() - started)

    async def answer(
        self,
        route: str,
        body: bytes,
        headers: dict[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
        client_gone: asyncio.Future[None],
    ) -> None:
        """Routes one whole generation request and sends the engine's answer, or the error, through `send`.

        `client_gone` is done once the client has left: the request is then given up (and aborted at its engine),
        with nothing sent. An answer cut short after its head was sent raises the RlfleetError it ended with.
        """
        response: Response
        try:
            response = await self.fleet.generate(
                route, body, headers, arrived_at=time.perf_counter(), client_gone=client_gone
            )
        except ClientGone as exc:
            logger.info("%s %s given up: %s", scope["method"], route, exc)
            return
        except RlfleetError as exc:
            if exc.http_status >= 500:
                logger.error("%s %s failed: %s", scope["method"], route, exc)
            response = error_answer(exc, self.fleet.config, route)
        except Exception:
            logger.exception("%s %s failed", scope["method"], route)
            response = route_error_response(route, Internal("internal error; see the service log"))
        await response(scope, receive, send)


async def watch_disconnect(receive: Receive, gone: asyncio.Future[None]) -> None:
    """Completes `gone` when the client disconnects (the request's body was read whole before)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not gone.done():
        gone.set_result(None)


def error_answer(error: RlfleetError, config: RouterConfig, route: str = "") -> Response:
    """`error` in the API's error shape (OpenAI's on its routes: `openai_errors`). A 503 for want of a healthy engine
    says when to ask again: after the next round of health checks, which may bring an engine back."""
    response = route_error_response(route, error)
    if isinstance(error, NoHealthyEngine):
        response.headers["retry-after"] = str(max(1, math.ceil(config.health_check_interval_secs)))
    return response


def method_not_allowed(method: str, route: str, allowed: tuple[str, ...]) -> Response:
    """405 in the API's error shape (as the app answers one), its Allow header naming the methods `route` takes."""
    takes = ", ".join(allowed)
    response = route_error_response(
        route, MethodNotAllowed(f"{method} {route}: method not allowed; this path takes {takes}")
    )
    response.headers["allow"] = takes
    return response


async def within_deadline(write: Awaitable[None], deadline: float, route: str) -> None:
    """Awaits `write` (of an answer to its client) until `deadline` (time.monotonic()): a client that stops reading
    must not hold its engine's answer, and the engine's slot, past the request's deadline. DeadlineExceeded then."""
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            await write
    except TimeoutError:
        error = DeadlineExceeded(f"{route}: answer cut short: its client did not read it within the request's deadline")
        logger.warning("%s", error)
        raise error from None


def header_dict(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by name (servers give the names lower-case). A name on several lines gets their
    values joined by ", " in order, as HTTP allows (RFC 9110, 5.3): the engine sees every value."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in pairs:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


async def read_body(receive: Receive, declared: str | None, max_bytes: int) -> bytes | None:
    """The request body; None if the client went away before sending all of it.

    ResourceExhausted (413) for a body over `max_bytes`: at once when its Content-Length says so,
    else as soon as the bytes received pass the bound, so an unbounded body is never buffered.
    """
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def too_large(max_bytes: int) -> ResourceExhausted:
    # The same words as `rlfleet.http_limits`, which bounds every other route.
    return ResourceExhausted(f"request body over {max_bytes} bytes; send less")
