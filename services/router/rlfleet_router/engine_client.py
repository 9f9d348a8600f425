"""Keep-alive HTTP/1.1 connections to the engines: the client the proxy relays generation traffic over.

Lean on purpose, since its cost is most of the latency the router adds: a request goes out in one
write (head and body together), its answer is parsed by httptools' C parser as the bytes arrive, and
an idle connection is taken from and given back to its engine's pool in O(1). aiohttp, which did this
job before, spent about 0.4 ms more of router time per request on its request and response objects,
header multidicts and timer contexts.

It does what the proxy needs and no more: a connect timeout and one bound on the whole answer (however
its bytes trickle in), one connection per request in flight, bodies read whole or chunk by chunk
(chunked encoding undone) with backpressure, and failures in two kinds: `EngineConnectionError`, the
engine could not be reached or the connection broke, so another engine may serve the request;
`EngineReadTimeout`, the engine has the request but its answer was not complete within the bound. An
`Interrupt` ends a request's waits from outside its task (its engine failed, its client left) with an
error of the caller's choosing, and drops its connection, without a task watching each request.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

# A streamed answer buffered beyond this (its client reads slower than the engine writes) stops reading
# from the engine until half of it is relayed.
MAX_BUFFERED_BYTES = 1 << 20
# A kept-alive connection that closes this soon after a request was written on it, before any byte of an answer,
# was closed by the engine while idle (its close crossed the request): the engine never started on the request.
# One that closes later may have held the request for any time: sending it again is the proxy's decision. The
# margin covers a busy event loop noticing the close late (misjudged, a healthy engine is charged a failure).
IDLE_CLOSE_SECS = 0.05


class EngineConnectionError(ConnectionError):
    """No answer over this connection: refused, connect timed out, reset, closed early or malformed."""


class EngineConnectTimeout(EngineConnectionError):
    """The connection was not open within the connect bound."""


class EngineConnectionLost(EngineConnectionError):
    """The connection broke, or the answer was malformed, after the request was written: the engine may have it."""


class EngineReadTimeout(TimeoutError):
    """The engine has the request but its answer was not complete within the read bound."""


class Interrupt:
    """Ends one request's waits for its answer from outside the task that waits: `fire(error)` makes the current
    or next wait raise `error` and closes the connection (so the engine sees the request's caller go).
    `stop_sending(error)` only keeps the request from being written from then on (it raises `error` instead): one
    already written is left as it is. `sent_at` tells when the request was written (an abort sent to its engine
    about then may reach the engine before the request does), and `on_sent`, if set, is called once it is."""

    __slots__ = ("error", "connection", "unsent", "sent_at", "on_sent")

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.connection: _Connection | None = None  # while the request holds one
        self.unsent: BaseException | None = None
        self.sent_at: float | None = None  # time.monotonic() when the request was written
        self.on_sent: Callable[[], None] | None = None

    def fire(self, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = error
        if self.connection is not None:
            self.connection.interrupt(error)

    def stop_sending(self, error: BaseException) -> None:
        if self.unsent is None:
            self.unsent = error

    def check(self) -> None:
        """Raises the error the request must end with before it is written, if any."""
        if self.error is not None:
            raise self.error
        if self.unsent is not None:
            raise self.unsent


class Origin(NamedTuple):
    host: str
    port: int
    tls: bool
    host_header: str

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        if parts.hostname is None:
            raise ValueError(f"engine URL {url!r} has no host")
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, parts.netloc)


class EngineAnswer:
    """An answer's status and headers, and its body read whole (`read`) or chunk by chunk (`read_chunk`).

    `release()` once the body is read gives the connection back to its pool; `close()` drops it (an
    answer cut short leaves a connection no other request can use).
    """

    def __init__(self, connection: _Connection, status: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.raw_headers = raw_headers
        self.content_length: int | None = None
        self.content_type = ""
        for name, value in raw_headers:
            lower = name.lower()
            if lower == b"content-length" and value.isdigit():
                self.content_length = int(value)
            elif lower == b"content-type":
                self.content_type = value.decode("latin-1")
        self._connection = connection

    async def read_chunk(self) -> bytes | None:
        """The next piece of the body as it arrived; None at its end."""
        return await self._connection.read_chunk()

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._connection.read_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        self._connection.release()

    def close(self) -> None:
        self._connection.close()


class _Connection(asyncio.Protocol):
    """One connection to an engine; carries one request at a time. httptools calls the `on_*` methods."""

    def __init__(self, client: EngineClient, origin: Origin) -> None:
        self._client = client
        self.origin = origin
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._sent_at = 0.0
        self._lost_at = math.inf
        self._read_timeout = 0.0
        self._read_deadline = 0.0  # time.monotonic() by which the answer must be whole
        self._interrupt: Interrupt | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self._status: int | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._complete = False
        self.answered = False
        self._until_close = False
        self._keep_alive = False
        self._error: BaseException | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineConnectionLost(f"malformed answer from the engine: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost_at = time.monotonic()
        self.closed = True
        self._client.forget(self)
        if self._until_close and self._error is None:
            self._complete = True  # an answer without length or chunks ends with its connection
            self._wake()
        elif not self._complete:
            reason = f": {exc}" if exc else ""
            self._fail(EngineConnectionLost(f"the engine closed the connection before its answer was complete{reason}"))

    # httptools
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = []
            return
        self._status = status
        chunked = any(n.lower() == b"transfer-encoding" and b"chunked" in v.lower() for n, v in self._headers)
        lengthless = all(n.lower() != b"content-length" for n, _ in self._headers)
        self._until_close = lengthless and not chunked and status not in (204, 304)
        self._keep_alive = self._parser.should_keep_alive()  # read now: the parser forgets it once the answer ends
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > MAX_BUFFERED_BYTES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._status is not None:
            self._complete = True
            self._wake()

    # the request
    def send(self, head: bytes, body: bytes, deadline: float, read_timeout: float, interrupt: Interrupt | None) -> None:
        """Writes the request, its answer due whole by `deadline` (time.monotonic(); `read_timeout` names the bound
        in the error), unless `interrupt` has fired or stopped its sending already (its error is raised: nothing is
        sent)."""
        assert self._transport is not None
        if interrupt is not None:
            interrupt.check()
            interrupt.connection = self
            self._interrupt = interrupt
        self._reset()
        self._read_timeout = read_timeout
        self._read_deadline = deadline
        self._sent_at = time.monotonic()
        self._transport.write(head + body if body else head)
        if interrupt is not None:
            interrupt.sent_at = self._sent_at
            if interrupt.on_sent is not None:
                interrupt.on_sent()

    def closed_while_idle(self) -> bool:
        """Whether the engine closed the connection at once after the request was written, with no byte of an
        answer (a failed write ends it at once too): it closed the connection idle and never saw the request."""
        return not self.answered and self._lost_at - self._sent_at < IDLE_CLOSE_SECS

    async def answer(self) -> EngineAnswer:
        while self._status is None:
            await self._wait()
        return EngineAnswer(self, self._status, self._headers)

    async def read_chunk(self) -> bytes | None:
        while not self._chunks:
            if self._complete:
                return None
            await self._wait()
        if not self._complete and time.monotonic() > self._read_deadline:
            # Pieces always at hand (an engine writing faster than the client reads) never wait: checked here.
            raise self._timed_out()
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= MAX_BUFFERED_BYTES // 2 and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    def release(self) -> None:
        # Detached first: an interrupt of the finished request must never reach the connection's next one.
        self._detach()
        if self._complete and self._keep_alive and not self.closed and not self._until_close:
            self._client.give_back(self)
        else:
            self.close()

    def close(self) -> None:
        self._detach()
        self.closed = True
        self._client.forget(self)
        if self._transport is not None:
            self._transport.close()

    def interrupt(self, error: BaseException) -> None:
        self._fail(error)
        self.close()

    def _detach(self) -> None:
        if self._interrupt is not None:
            self._interrupt.connection = None
            self._interrupt = None

    async def _wait(self) -> None:
        """Until the parser has news (headers, body, end) or the read deadline passes."""
        if self._error is not None:
            raise self._error
        # One deadline for the whole answer: bytes trickling in must not keep a request alive past its bound.
        left = self._read_deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out()
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(left, self._expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        # The first cause is kept: the connection closing after an interrupt or a parse error is its consequence.
        if self._error is None:
            self._error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self._error)

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(self._timed_out())

    def _timed_out(self) -> EngineReadTimeout:
        return EngineReadTimeout(f"the engine's answer was not complete within {self._read_timeout:.3g}s")


# Engine URLs whose parsed form is kept; past it the cache starts over, so engines that came and went do not
# stay in it for good.
MAX_ORIGINS = 1024


class EngineClient:
    """Pools of idle keep-alive connections, one per engine, most recently used first; `close()` drops them all."""

    def __init__(self, keepalive_secs: float = 60.0) -> None:
        self._keepalive_secs = keepalive_secs
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, dict[_Connection, None]] = {}  # insertion-ordered: the last is the freshest
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        connect_timeout: float,
        read_timeout: float,
        interrupt: Interrupt | None = None,
    ) -> EngineAnswer:
        """Sends the request and waits for the answer's status and headers.

        `read_timeout` bounds the whole answer, from the request's sending to its body's last byte;
        `interrupt`, once fired, ends this wait or the body's with its error.

        A connection taken from the pool that the engine turns out to have closed while idle (it closes at once,
        unanswered: `closed_while_idle`) is replaced by a new one once, within the same bound, since the engine
        never saw the request. One that closes later raises EngineConnectionLost: the engine may have held the
        request all that time, and only the caller knows whether to send it again.
        """
        if interrupt is not None:
            interrupt.check()
        origin = self._origins.get(base_url)
        if origin is None:
            if len(self._origins) >= MAX_ORIGINS:  # engines that came and went (pods by IP): parsed again on use
                self._origins.clear()
            origin = self._origins[base_url] = Origin.of(base_url)
        head = request_head(method, path, origin.host_header, headers, len(body))
        deadline = time.monotonic() + read_timeout
        connection = self._take(origin)
        if connection is not None:
            try:
                connection.send(head, body, deadline, read_timeout, interrupt)
                return await connection.answer()
            except EngineConnectionError:
                connection.close()
                if not connection.closed_while_idle():
                    raise
            except BaseException:
                connection.close()
                raise
        connection = await self._connect(origin, connect_timeout)
        try:
            connection.send(head, body, deadline, read_timeout, interrupt)
            return await connection.answer()
        except BaseException:
            connection.close()
            raise

    async def close(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._idle.clear()

    def give_back(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, {})[connection] = None

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle is not None:
            idle.pop(connection, None)
            if not idle:  # no pool is kept for an engine without idle connections
                del self._idle[connection.origin]

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        expired = time.monotonic() - self._keepalive_secs
        while idle:
            connection, _ = idle.popitem()
            if connection.closed:
                continue
            if connection.idle_since < expired:
                connection.close()
                continue
            return connection
        return None

    async def _connect(self, origin: Origin, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        if origin.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port, ssl=self._tls if origin.tls else None
                )
        except TimeoutError as exc:
            raise EngineConnectTimeout(
                f"connecting to {origin.host}:{origin.port} timed out after {timeout:.3g}s"
            ) from exc
        except OSError as exc:
            raise EngineConnectionError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        self._open.add(connection)
        return connection


def request_head(method: str, path: str, host: str, headers: Mapping[str, str], length: int) -> bytes:
    """The request line and headers; the length is always sent, so the engine never waits for a body end."""
    lines = [f"{method} {path} HTTP/1.1\r\nhost: {host}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
    lines.append(f"content-length: {length}\r\n\r\n")
    return "".join(lines).encode("latin-1")
