"""Forwarding a request to one engine: selection, in-flight counting, retries, streaming back.

The request body goes to the engine as the bytes that arrived, so fields the router does not
know reach the engine untouched; the engine's answer goes back with its bytes unchanged (a plain
answer whole, with its content-length; a stream chunk by chunk as it arrives), with a copy of the
bytes read for the prompt and cached tokens the engine reports (`engine_usage`; for a text prompt they
also teach the router the engines' characters per token, `chars_per_token`). A request is
retried on another engine only while nothing has been sent back yet, and only for a connection
failure or a 5xx, with exponential backoff inside the request's deadline.

The relay uses `engine_client`, keep-alive connections pooled per engine and parsed in C: the
client is most of the latency the router adds to a request, so it is kept to what the relay needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rlfleet.errors import DeadlineExceeded, RlfleetError, Unavailable
from rlfleet.http_errors import error_response
from rlfleet_router.chars_per_token import CharsPerToken
from rlfleet_router.engine_client import EngineAnswer, EngineClient, EngineConnectionError, EngineReadTimeout
from rlfleet_router.engine_usage import PromptUsage, UsageTap
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import Policy, RoutingRequest
from rlfleet_router.weights import describe_error
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) plus the host, which names the router, not the engine.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
)
# Of an answer, the router's server sets its own date and server fields: relayed too, each would appear twice.
DROPPED_ANSWER_HEADER_NAMES = frozenset(name.encode() for name in HOP_HEADERS | {"date", "server"})
# A request's length is recomputed for the bytes sent; an answer's is kept, as its bytes are relayed unchanged.
# The caller's Authorization is the fleet's API token, meant for the router: engines never see it.
DROPPED_REQUEST_HEADERS = HOP_HEADERS | {"content-length", "authorization"}
# Idle connections to an engine are kept this long for the next request.
KEEPALIVE_SECS = 60.0
ENGINE_HEADER = "x-rlfleet-engine"
ENGINE_HEADER_NAME = ENGINE_HEADER.encode()
# Answers kept whole for an `on_answer` reader (trajectories); a larger one is relayed but not read.
MAX_CAPTURED_BYTES = 32 * 1024 * 1024
# Plain answers up to this size are read whole and sent in one piece; larger ones are relayed as streams.
MAX_WHOLE_ANSWER_BYTES = 8 * 1024 * 1024

# Receives a complete 200 answer and the engine that gave it, after its last byte was relayed.
AnswerReader = Callable[[bytes, Worker], None]
# Receives the prompt tokens and cached tokens a complete 200 answer reports.
UsageReader = Callable[[PromptUsage], None]


class RetryableFailure(Exception):
    """The engine failed in a way another engine may not (connection failure or 5xx); nothing was relayed."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int
    initial_backoff_secs: float
    max_backoff_secs: float
    multiplier: float

    def backoff(self, retry: int) -> float:
        """Wait before retry number `retry` (1-based)."""
        return min(self.max_backoff_secs, self.initial_backoff_secs * self.multiplier ** (retry - 1))


def forwardable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in DROPPED_REQUEST_HEADERS}


class EngineResponse(StreamingResponse):
    """An engine's answer relayed as it arrives; releases the engine slot however the relay ends.

    A plain answer (one with a content-length, up to `MAX_WHOLE_ANSWER_BYTES`) is already whole at the
    engine: it is read in one go and sent as one body, without an async generator or a task watching for
    the client's disconnect, which cost more router CPU than the relay itself. A stream (SSE, or no
    length) is relayed chunk by chunk.
    """

    def __init__(
        self,
        upstream: EngineAnswer,
        worker: Worker,
        workers: WorkerRegistry,
        deadline: float,
        tokens: int,
        metrics: RouterMetrics,
        on_answer: AnswerReader | None = None,
        on_usage: UsageReader | None = None,
    ) -> None:
        super().__init__(self._relay(), status_code=upstream.status)
        # Straight from the engine's raw headers (duplicates such as set-cookie kept), names lower-cased for ASGI.
        raw = [
            (lower, value)
            for name, value in upstream.raw_headers
            if (lower := name.lower()) not in DROPPED_ANSWER_HEADER_NAMES
        ]
        raw.append((ENGINE_HEADER_NAME, worker.url.encode("latin-1")))
        self.raw_headers = raw
        self._upstream = upstream
        length = upstream.content_length
        self._whole = length is not None and length <= MAX_WHOLE_ANSWER_BYTES
        self._worker = worker
        self._workers = workers
        self._deadline = deadline
        self._tokens = tokens
        self._metrics = metrics
        self._tap = UsageTap(upstream.content_type) if upstream.status == 200 else None
        self._on_answer = on_answer if upstream.status == 200 else None
        self._on_usage = on_usage
        self._answer = bytearray()
        self._released = False
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self._whole:
                await self._relay_whole(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        finally:
            await self.release()

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._worker.in_flight -= 1
        self._worker.in_flight_tokens -= self._tokens
        if self._complete:
            self._upstream.release()  # read to its end: the connection goes back to the engine's pool
        else:
            self._upstream.close()  # an answer cut short leaves the connection unusable

    async def _relay_whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        error: RlfleetError
        try:
            body = await self._upstream.read()  # each wait bounded by the time left when the request was sent
        except EngineReadTimeout as exc:
            error = DeadlineExceeded(f"{self._worker.url} did not finish its answer in time ({describe_error(exc)})")
        except EngineConnectionError as exc:
            reason = f"connection lost mid-response: {describe_error(exc)}"
            self._workers.record_failure(self._worker, reason)
            error = Unavailable(f"{self._worker.url}: {reason}")
        else:
            await self._send_whole(body, send)
            return
        # Nothing has reached the client yet: it gets an error in the router's shape, not a cut answer.
        logger.warning("answer from %s not relayed: %s", self._worker.url, error)
        await error_response(error)(scope, receive, send)

    async def _send_whole(self, body: bytes, send: Send) -> None:
        # Released before the client has the answer, so a client that sends its next request on receipt
        # already finds this engine's load decremented.
        self._complete = True
        await self.release()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": body})
        # Counting and trajectory capture happen once the client has its answer: off its critical path.
        if self._tap is not None:
            self._tap.feed(body)
        self._finish(body)

    def _finish(self, answer: bytes) -> None:
        """Counts the prompt and cached tokens the answer reports and hands it to its reader, if any."""
        usage = self._tap.result() if self._tap is not None else None
        if usage is not None:
            self._metrics.engine_prompt_tokens(self._worker.url).inc(usage.prompt_tokens)
            self._metrics.engine_cached_tokens(self._worker.url).inc(usage.cached_tokens)
            if self._on_usage is not None:
                self._on_usage(usage)
        if self._on_answer is not None:
            self._on_answer(answer, self._worker)

    async def _relay(self) -> AsyncIterator[bytes]:
        try:
            # Each read is bounded by the time left when the request was sent; the check below ends a
            # stream that keeps trickling past the deadline.
            while (chunk := await self._upstream.read_chunk()) is not None:
                yield chunk
                if self._tap is not None:
                    self._tap.feed(chunk)
                if self._on_answer is not None:
                    self._answer += chunk
                    if len(self._answer) > MAX_CAPTURED_BYTES:
                        logger.warning("answer from %s too large to read for its trajectory", self._worker.url)
                        self._on_answer = None
                if time.monotonic() > self._deadline:
                    raise TimeoutError(f"request to {self._worker.url} exceeded its deadline")
            self._complete = True
            await self.release()
            self._finish(bytes(self._answer))
        except TimeoutError:  # EngineReadTimeout included
            # Ending the body early would look like a complete answer; failing the connection does not.
            logger.warning("request to %s exceeded its deadline mid-response; aborting it", self._worker.url)
            raise
        except EngineConnectionError as exc:
            self._workers.record_failure(self._worker, f"connection lost mid-response: {describe_error(exc)}")
            raise


class Proxy:
    """Relays requests to engines; `start()` (in the serving event loop) before the first, `stop()` after the last."""

    def __init__(
        self,
        workers: WorkerRegistry,
        policy: Policy,
        metrics: RouterMetrics,
        retry: RetryPolicy,
        chars_per_token: CharsPerToken,
        request_timeout_secs: float,
        connect_timeout_secs: float,
    ) -> None:
        self._client: EngineClient | None = None
        self._chars_per_token = chars_per_token
        self._workers = workers
        self._policy = policy
        self._metrics = metrics
        self._retry = retry
        self._request_timeout = request_timeout_secs
        self._connect_timeout = connect_timeout_secs

    async def start(self) -> None:
        # No cap on connections (streams stay open for a whole generation: a cap would queue requests behind
        # them), no proxy from the environment, no decoding of answers, no headers but the client's own.
        self._client = EngineClient(keepalive_secs=KEEPALIVE_SECS)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def forward(
        self,
        routing: RoutingRequest,
        body: bytes,
        headers: Mapping[str, str],
        method: str = "POST",
        arrived_at: float | None = None,
        on_answer: AnswerReader | None = None,
    ) -> EngineResponse:
        """Sends `body` to `routing.route` on an engine the policy picks; returns its streaming answer.

        `arrived_at` (time.perf_counter() when the body was read) times the router's own part;
        `on_answer` reads the complete answer of the one attempt whose answer reached the client.
        """
        deadline = time.monotonic() + self._request_timeout
        forwarded = forwardable_headers(headers)
        tried: set[str] = set()
        retries = 0
        while True:
            worker = self._choose(routing, tried)
            if arrived_at is not None and not tried:
                self._metrics.added_latency.observe(time.perf_counter() - arrived_at)
            tried.add(worker.id)
            last_try = retries >= self._retry.max_retries
            try:
                return await self._send(worker, method, routing, body, forwarded, deadline, last_try, on_answer)
            except RetryableFailure as exc:
                failure = str(exc)
            retries += 1
            if retries > self._retry.max_retries:
                raise Unavailable(f"{routing.route} failed on {len(tried)} engine(s); last error: {failure}")
            wait = self._retry.backoff(retries)
            if time.monotonic() + wait >= deadline:
                raise DeadlineExceeded(
                    f"{routing.route} ran out of time after {retries} attempt(s); last error: {failure}"
                )
            self._metrics.retries.inc()
            logger.info("retrying %s on another engine in %.3fs: %s", routing.route, wait, failure)
            await asyncio.sleep(wait)

    def _choose(self, routing: RoutingRequest, tried: set[str]) -> Worker:
        healthy = self._workers.healthy()
        if not healthy:
            total = len(self._workers.all())
            raise Unavailable(f"no healthy engine: 0 of {total} engines are in routing; GET /workers shows why")
        # Prefer engines not tried yet; with all of them tried, any healthy one may have recovered.
        untried = [w for w in healthy if w.id not in tried]
        choice = self._policy.select(untried or healthy, routing)
        self._metrics.routing_decision(choice.reason).inc()
        return choice.worker

    async def _send(
        self,
        worker: Worker,
        method: str,
        routing: RoutingRequest,
        body: bytes,
        headers: dict[str, str],
        deadline: float,
        last_try: bool,
        on_answer: AnswerReader | None = None,
    ) -> EngineResponse:
        """The engine's response; RetryableFailure for a connection failure, or a 5xx unless `last_try`."""
        route = routing.route
        tokens = routing.tokens if routing.body else 0
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"{route} ran out of time before an engine answered")
        if self._client is None:
            raise Unavailable("the router is not serving yet (its engine connections are not open)")
        worker.in_flight += 1
        worker.in_flight_tokens += tokens
        try:
            # Each wait for the answer is bounded by the time left; see EngineResponse._relay for the whole.
            upstream = await self._client.request(
                method, worker.url, route, body, headers, min(self._connect_timeout, remaining), remaining
            )
        except EngineReadTimeout as exc:  # the engine has the request: resending it elsewhere would double it
            self._unload(worker, tokens)
            raise DeadlineExceeded(f"{worker.url} did not answer {route} in time ({describe_error(exc)})") from exc
        except EngineConnectionError as exc:
            self._unload(worker, tokens)
            self._metrics.engine_errors.labels(engine=worker.url, kind="connection").inc()
            reason = f"{worker.url}: {describe_error(exc)}"
            self._workers.record_failure(worker, reason)
            raise RetryableFailure(reason) from exc
        except BaseException:
            self._unload(worker, tokens)
            raise
        if upstream.status >= 500:
            self._metrics.engine_errors.labels(engine=worker.url, kind="http_5xx").inc()
            if not last_try:
                self._unload(worker, tokens)
                upstream.close()
                raise RetryableFailure(f"{worker.url}: HTTP {upstream.status}")
        # The prompt tokens an engine reports for one text prompt teach the router the engines' tokenizer.
        chars = routing.single_text_chars
        on_usage = None if chars is None else lambda usage: self._chars_per_token.observe(chars, usage.prompt_tokens)
        return EngineResponse(upstream, worker, self._workers, deadline, tokens, self._metrics, on_answer, on_usage)

    @staticmethod
    def _unload(worker: Worker, tokens: int) -> None:
        worker.in_flight -= 1
        worker.in_flight_tokens -= tokens
