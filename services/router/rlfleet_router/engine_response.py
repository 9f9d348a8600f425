"""An engine's answer as the client gets it: the engine's status, headers and bytes, unchanged.

The proxy hands it over once the answer is committed to: a plain answer already read whole, or a
stream whose first piece has arrived. The bytes going by are copied for the prompt and cached tokens
the engine reports (`engine_usage`) and, for a trajectory, the whole answer. A stream that breaks after
its first piece cannot move to another engine (part of it was delivered): it ends with an error, an
SSE error event in the router's error shape (OpenAI's on its routes, `openai_errors`) when the stream stands
between two events, then a cut connection rather than a false end. A stream given up at the request's deadline
(its engine too slow, or its client not reading), or whose client left, is also aborted at its engine by rid.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rlfleet.errors import DeadlineExceeded, RlfleetError, Unavailable
from rlfleet_router.engine_attempts import Attempt, EngineFailed
from rlfleet_router.engine_client import EngineAnswer, EngineConnectionError, EngineReadTimeout
from rlfleet_router.engine_usage import PromptUsage, UsageTap
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.openai_errors import route_error_body
from rlfleet_router.weights import describe_error
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) plus the host, which names the router, not the engine.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
)
# Of an answer, the router's server sets its own date and server fields: relayed too, each would appear twice.
DROPPED_ANSWER_HEADER_NAMES = frozenset(name.encode() for name in HOP_HEADERS | {"date", "server"})
ENGINE_HEADER = "x-rlfleet-engine"
ENGINE_HEADER_NAME = ENGINE_HEADER.encode()
# Answers relayed in pieces are kept whole for an `on_answer` reader (trajectories) up to this size; a larger
# one is relayed but not kept, and its reader is told so.
MAX_CAPTURED_BYTES = 32 * 1024 * 1024
SSE_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")

# Receives a complete 200 answer (None: relayed whole but over MAX_CAPTURED_BYTES, so not kept) and the engine
# that gave it, after its last byte was relayed.
AnswerReader = Callable[[bytes | None, Worker], None]
# Receives the prompt tokens and cached tokens a complete 200 answer reports.
UsageReader = Callable[[PromptUsage], None]
# Asks the engine of an ended attempt to abort its request, saying why.
Abort = Callable[[Attempt, str], None]


class EngineResponse(StreamingResponse):
    """An engine's answer relayed to the client; ends the request's attempt at the engine however the relay ends.

    `body` is the whole of a plain answer (`whole`), read before the answer was committed to: it is sent as
    one body, without an async generator or a task watching for the client's disconnect, which cost more
    router CPU than the relay itself. Otherwise it is a stream's first piece (None: an empty body), and the
    rest is relayed chunk by chunk as it arrives.
    """

    def __init__(
        self,
        upstream: EngineAnswer,
        attempt: Attempt,
        body: bytes | None,
        whole: bool,
        workers: WorkerRegistry,
        metrics: RouterMetrics,
        abort: Abort,
        on_answer: AnswerReader | None = None,
        on_usage: UsageReader | None = None,
        route: str = "",
    ) -> None:
        super().__init__(self._relay(), status_code=upstream.status)
        worker = attempt.worker
        # Straight from the engine's raw headers (duplicates such as set-cookie kept), names lower-cased for ASGI.
        raw = [
            (lower, value)
            for name, value in upstream.raw_headers
            if (lower := name.lower()) not in DROPPED_ANSWER_HEADER_NAMES
        ]
        raw.append((ENGINE_HEADER_NAME, worker.url.encode("latin-1")))
        self.raw_headers = raw
        self._upstream = upstream
        self._attempt = attempt
        self._body = body
        self._whole = whole
        self._worker = worker
        self._workers = workers
        self._metrics = metrics
        self._abort = abort
        self._route = route  # names the shape of a stream's error event (OpenAI's on its routes)
        self._tap = UsageTap(upstream.content_type) if upstream.status == 200 else None
        self._on_answer = on_answer if upstream.status == 200 else None
        self._on_usage = on_usage
        self._answer: bytearray | None = bytearray()  # None once over MAX_CAPTURED_BYTES
        self._sse = upstream.content_type.startswith("text/event-stream")
        self._between_events = True
        self._complete = whole
        self._released = whole  # the proxy ended a plain answer's attempt when it had read it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._whole:
            await self._send_whole(send)
            return
        try:
            await super().__call__(scope, receive, send)
        except DeadlineExceeded:
            # Given up, not finished: the engine may still be generating the rest.
            self.release()
            self._abort(self._attempt, "past its deadline")
            raise
        finally:
            if not self._released:
                # Ended before its answer did, unasked by the engine (whose failures release it first): the client
                # left mid-stream. The closed connection alone stops the engine late, or never.
                cut_short = not self._complete
                self.release()
                if cut_short:
                    self._abort(self._attempt, "its client left")

    def release(self) -> None:
        """Ends the attempt; the connection goes back to the engine's pool if the answer was read to its end."""
        if self._released:
            return
        self._released = True
        self._attempt.end()
        if self._complete:
            self._upstream.release()
        else:
            self._upstream.close()  # an answer cut short leaves the connection unusable

    async def _send_whole(self, send: Send) -> None:
        body = self._body or b""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": body})
        # Counting and trajectory capture happen once the client has its answer: off its critical path.
        if self._tap is not None:
            self._tap.feed(body)
        self._finish(body)

    def _finish(self, answer: bytes | None) -> None:
        """Counts the prompt and cached tokens the answer reports and hands it to its reader, if any."""
        usage = self._tap.result() if self._tap is not None else None
        if usage is not None:
            self._metrics.prompt_tokens.inc(self._worker.url, amount=usage.prompt_tokens)
            self._metrics.cached_tokens.inc(self._worker.url, amount=usage.cached_tokens)
            if self._on_usage is not None:
                self._on_usage(usage)
        if self._on_answer is not None:
            self._on_answer(answer, self._worker)

    async def _relay(self) -> AsyncIterator[bytes]:
        chunk = self._body
        try:
            # Every read is bounded by the request's deadline, for the whole answer however it trickles.
            while chunk is not None:
                yield chunk
                self._read(chunk)
                chunk = await self._upstream.read_chunk()
        except (EngineReadTimeout, EngineConnectionError, EngineFailed) as exc:
            error = self._cut_short(exc)
            if self._sse and self._between_events:
                yield b"data: " + json.dumps(route_error_body(self._route, error)).encode() + b"\n\n"
            # Ending the body now would look like a complete answer; failing the connection does not.
            raise error from exc
        self._complete = True
        self.release()
        self._finish(None if self._answer is None else bytes(self._answer))

    def _read(self, chunk: bytes) -> None:
        if self._tap is not None:
            self._tap.feed(chunk)
        if self._on_answer is not None and self._answer is not None:
            self._answer += chunk
            if len(self._answer) > MAX_CAPTURED_BYTES:
                # The reader still hears of the answer: a trajectory turn that silently went missing would let
                # the next turn lay the model's own tokens out as prompt tokens.
                self._answer = None
        self._between_events = chunk.endswith(SSE_EVENT_ENDS)

    def _cut_short(self, exc: Exception) -> RlfleetError:
        """The error a stream broken by `exc` ends with, counted against its engine where the engine is at fault."""
        self.release()  # before the failure is recorded: an engine taken out interrupts the attempts still there
        url = self._worker.url
        error: RlfleetError
        if isinstance(exc, EngineReadTimeout):
            error = DeadlineExceeded(f"stream cut short: {url} did not finish its answer within the request's deadline")
        elif isinstance(exc, EngineFailed):
            self._metrics.engine_errors.inc(url, "engine_failed")
            # Taken out of routing, the engine may still be generating: the closed connection alone stops it late.
            self._abort(self._attempt, "its engine failed")
            error = Unavailable(f"stream cut short: {exc}")
        else:
            reason = f"connection lost mid-response: {describe_error(exc)}"
            self._metrics.engine_errors.inc(url, "connection")
            self._workers.record_failure(self._worker, reason)
            self._abort(self._attempt, "its connection was lost")
            error = Unavailable(f"stream cut short: {url}: {reason}")
        logger.warning("%s", error)
        return error
