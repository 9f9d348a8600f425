"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol (with the services' bound on a request's
head, `rlfleet.http_head_limit`), with generation requests served from the parser.

A generation request (POST `/generate` and the OpenAI routes, PUT `/generate`) is most of a router's
traffic, and uvicorn's per-request ASGI machinery (scope, request-response cycle, event, message dicts,
header checks on every send) costs about as much of the router's added latency as the routing itself.
Here such a request is read into a `GenerationExchange` that takes the place of uvicorn's cycle while its body
arrives, so uvicorn's own parser callbacks, keep-alive timer, pipelining, flow control and shutdown
work on it unchanged; once the body is whole it goes to `GenerationRelay.answer` in one task, and
the answer is written back with its head in one write. Every other request, and a generation
request pipelined behind one in progress, takes uvicorn's path to the app. Writes to a client that
stops reading wait until the request's deadline at most.

Selected with `uvicorn.run(..., http=RouterHttpProtocol)`; without a `GenerationRelay` in the app it
behaves as uvicorn's protocol. Middleware uvicorn puts around the app does not see generation requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from starlette.types import Message, Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from rlfleet.errors import Internal, RlfleetError
from rlfleet.http_head_limit import HeadLimitedHttpProtocol
from rlfleet_router.generation_relay import (
    CLIENT_CLOSED_REQUEST,
    GenerationRelay,
    header_dict,
    too_large,
    within_deadline,
)
from rlfleet_router.openai_errors import route_error_response

# The ASGI version uvicorn announces: streamed answers keep watching for the client's disconnect.
ASGI = {"version": "3.0", "spec_version": "2.3"}


class RouterHttpProtocol(HeadLimitedHttpProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.relay = find_relay(self.app)

    def on_headers_complete(self) -> None:
        self.end_head()
        relay = self.relay
        method = self.parser.get_method()
        if (
            relay is None
            or method not in (b"POST", b"PUT")
            or self.parser.should_upgrade()
            or self.expect_100_continue  # uvicorn's cycle sends the interim answer when the body is read
            or (self.cycle is not None and not self.cycle.response_complete)  # pipelined: uvicorn queues it
        ):
            super().on_headers_complete()
            return
        path = httptools.parse_url(self.url).path.decode("latin-1")
        name = method.decode("latin-1")
        if name not in relay.methods.get(path, ()):  # a method the path does not take gets the relay's 405 there
            super().on_headers_complete()
            return
        keep_alive = self.parser.get_http_version() == "1.1" and self.parser.should_keep_alive()
        self.cycle = GenerationExchange(self, relay, name, path, keep_alive)  # type: ignore[assignment]


def find_relay(app: object) -> GenerationRelay | None:
    """The GenerationRelay in uvicorn's app, under the middleware uvicorn may have put around it (ProxyHeaders)."""
    while app is not None and not isinstance(app, GenerationRelay):
        app = getattr(app, "app", None)
    return app


class Wakeup:
    """Stands in for the cycle's asyncio.Event: uvicorn sets it on each body piece, at the body's end and on
    disconnect; each time, the exchange looks at what changed."""

    def __init__(self, exchange: GenerationExchange) -> None:
        self._exchange = exchange

    def set(self) -> None:
        self._exchange.on_news()


class GenerationExchange:
    """One generation request and its answer on a connection; carries the attributes uvicorn's protocol
    reads and writes on its cycle (body, more_body, keep_alive, disconnected, response_complete, message_event)."""

    def __init__(
        self, protocol: RouterHttpProtocol, relay: GenerationRelay, method: str, route: str, keep_alive: bool
    ) -> None:
        self.protocol = protocol
        self.relay = relay
        self.method = method
        self.route = route
        self.keep_alive = keep_alive
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_complete = False
        self.message_event = Wakeup(self)
        self.started = time.perf_counter()
        self.status = 500
        self._deadline = 0.0  # time.monotonic() by which the request is answered, from its body's end
        self._task: asyncio.Task[None] | None = None
        self._head: bytes | None = None  # the answer's status line and headers, until its first body piece
        self._chunked = False
        self._written = False
        self._gone: asyncio.Future[None] = protocol.loop.create_future()  # done once the client is gone
        self.raw_headers = protocol.headers  # the parser starts a new list for the next request on the connection
        self.headers = header_dict(self.raw_headers)
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > relay.max_bytes:
            self._refuse_too_large()

    def on_news(self) -> None:
        if self.disconnected:
            if not self._gone.done():
                self._gone.set_result(None)
            if self._task is None and not self.response_complete:  # gone before its body was whole
                self.response_complete = True
                self._observe(CLIENT_CLOSED_REQUEST)
            return
        if self._task is not None or self.response_complete:
            return
        if len(self.body) > self.relay.max_bytes:
            self._refuse_too_large()
        elif self.more_body:
            # uvicorn pauses reading once a body passes its buffer limit, for the app to take it piece by
            # piece; here the body is kept whole up to max_bytes, so reading goes on.
            self.protocol.flow.resume_reading()
        else:
            self._start(
                lambda scope: self.relay.answer(
                    self.route, bytes(self.body), self.headers, scope, self._receive, self._send, self._gone
                )
            )

    def _refuse_too_large(self) -> None:
        """Answers 413 at once and closes the connection: the rest of the body is not read."""
        self.keep_alive = False
        response = route_error_response(self.route, too_large(self.relay.max_bytes))
        self._start(lambda scope: response(scope, self._receive, self._send))

    def _start(self, answer: Callable[[Scope], Awaitable[None]]) -> None:
        self._deadline = time.monotonic() + self.relay.fleet.config.request_timeout_secs
        self._task = self.protocol.loop.create_task(self._serve(answer))
        self.protocol.tasks.add(self._task)
        self._task.add_done_callback(self.protocol.tasks.discard)

    async def _serve(self, answer: Callable[[Scope], Awaitable[None]]) -> None:
        scope: Scope = {
            "type": "http",
            "asgi": ASGI,
            "method": self.method,
            "path": self.route,
            "headers": self.raw_headers,
        }
        try:
            await answer(scope)
        except Exception as exc:
            # An RlfleetError here is an engine's answer cut short mid-relay, logged where it broke.
            error = exc if isinstance(exc, RlfleetError) else Internal("internal error; see the service log")
            if error is not exc:
                self.protocol.logger.exception("%s %s failed", self.method, self.route)
            if self._written:  # as uvicorn does: an answer cut short cannot be completed, so the connection ends
                self.status = error.http_status  # counted as what it is, not as the status its head announced
                if self.protocol.flow.write_paused:  # a client that stopped reading: closing would wait for it
                    self.protocol.transport.abort()
                else:
                    self.protocol.transport.close()
            else:  # nothing reached the client: an error in the router's shape
                self.keep_alive, self._head, self._chunked = False, None, False
                await route_error_response(self.route, error)(scope, self._receive, self._send)
        finally:
            self._end()

    def _end(self) -> None:
        self._observe(self.status if self.response_complete or not self.disconnected else CLIENT_CLOSED_REQUEST)
        if not self.response_complete:
            self.response_complete = True
            self.protocol.transport.close()

    def _observe(self, status: int) -> None:
        self.relay.fleet.metrics.observe_request(self.route, status, time.perf_counter() - self.started)

    async def _receive(self) -> Message:
        await self._gone
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self.disconnected:  # as uvicorn does: the answer goes nowhere; a stream ends on the disconnect
            return
        transport = self.protocol.transport
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self._head = self._response_head(self.status, message.get("headers", ()))
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self._chunked:
            body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        if self._head is not None:  # head and first piece in one write
            body, self._head = self._head + body, None
        if body:
            transport.write(body)
            self._written = True
        if self.protocol.flow.write_paused:
            await within_deadline(self.protocol.flow.drain(), self._deadline, self.route)
        if not more:
            self.response_complete = True
            if self.keep_alive:
                self.protocol.on_response_complete()
            else:
                transport.close()

    def _response_head(self, status: int, headers: Any) -> bytes:
        lines = [STATUS_LINE[status]]
        length = None
        for name, value in [*self.protocol.server_state.default_headers, *headers]:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            lines += [lower, b": ", value, b"\r\n"]
        if length is None:
            self._chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)
