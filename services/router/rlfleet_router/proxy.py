"""Forwarding a request to one engine: selection, in-flight counting, retries, handing the answer back.

The request body goes to the engine as the bytes that arrived, so fields the router does not know
reach the engine untouched; the engine's answer goes back with its bytes unchanged
(`engine_response`). A request is retried on another engine only while nothing has been sent back
yet, and only for a connection failure, a 5xx or an engine that left routing as failed while the
request was there, with exponential backoff inside the request's deadline. "Nothing sent back yet"
lasts until a plain answer is read whole or a stream's first piece has arrived: both are read here,
inside the retries.

A request at an engine can be interrupted from outside its task: by its engine failing
(`engine_failed`, told by the worker registry) or holding weights that would make its answer wrong
(`drop_requests`, told by the fan-out before it continues such an engine), or by its client leaving
(the `client_gone` future the HTTP layer completes on a disconnect). Each closes its connection; a
request given up at an engine that may still run it is also aborted there by rid (`engine_aborts`).

A repeat of a prompt its engine is about to prefill waits a few milliseconds before it is sent
(`prefill_stagger`), counted at the engine meanwhile; given up then, it was never sent.

A client's /abort_request reaches a request at no engine (held back, waiting to be retried, connecting) through
`held`: one it names ends with RequestAborted before it is ever written to an engine (again). Its engine is asked
again for one the abort may have missed there, written just before, and for the rids it named of a batch it did not
name whole, once written.

The relay uses `engine_client`, keep-alive connections pooled per engine and parsed in C: the
client is most of the latency the router adds to a request, so it is kept to what the relay needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from rlfleet.errors import DeadlineExceeded, Unavailable
from rlfleet_router.chars_per_token import CharsPerToken
from rlfleet_router.engine_aborts import EngineAborts
from rlfleet_router.engine_attempts import Attempt, ClientGone, EngineAttempts, EngineFailed
from rlfleet_router.engine_client import (
    EngineAnswer,
    EngineClient,
    EngineConnectionError,
    EngineConnectionLost,
    EngineConnectTimeout,
    EngineReadTimeout,
)
from rlfleet_router.engine_response import HOP_HEADERS, AnswerReader, EngineResponse
from rlfleet_router.held_requests import AbortAtEngine, HeldRequest, HeldRequests
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import Policy, RoutingRequest
from rlfleet_router.prefill_stagger import PrefillStagger
from rlfleet_router.weights import describe_error
from rlfleet_router.workers import NoHealthyEngine, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

# A request's length is recomputed for the bytes sent; an answer's is kept, as its bytes are relayed unchanged.
# The caller's Authorization is the fleet's API token, meant for the router: engines never see it.
DROPPED_REQUEST_HEADERS = HOP_HEADERS | {"content-length", "authorization"}
# Idle connections to an engine are kept this long for the next request.
KEEPALIVE_SECS = 60.0
# A request counts at most this many tokens in its engine's load: the largest integer a double holds exactly, so
# the load stays a number Prometheus exports whatever budget a request names (the engine judges the budget).
MAX_COUNTED_TOKENS = 2**53


class RetryableFailure(Exception):
    """The engine failed in a way another may not (connection failure, 5xx, engine failed); nothing was relayed."""


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
        max_whole_answer_bytes: int,
        prefill_stagger: PrefillStagger | None = None,
    ) -> None:
        self._client: EngineClient | None = None
        self._stagger = prefill_stagger if prefill_stagger is not None else PrefillStagger(0.0)
        self._chars_per_token = chars_per_token
        self._workers = workers
        self._policy = policy
        self._metrics = metrics
        self._retry = retry
        self._request_timeout = request_timeout_secs
        self._connect_timeout = connect_timeout_secs
        self._max_whole_answer = max_whole_answer_bytes
        self._attempts = EngineAttempts()
        self._aborts = EngineAborts(self._attempts, resent=metrics.client_aborts_resent)
        self.held = HeldRequests()

    async def start(self) -> None:
        # No cap on connections (streams stay open for a whole generation: a cap would queue requests behind
        # them), no proxy from the environment, no decoding of answers, no headers but the client's own.
        self._client = EngineClient(keepalive_secs=KEEPALIVE_SECS)

    async def stop(self) -> None:
        await self._aborts.close()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def engine_failed(self, worker: Worker) -> None:
        """`worker` left routing as failed: the requests there stop waiting for it (a hung engine answers none)."""
        self._attempts.engine_failed(worker)

    def drop_requests(self, worker: Worker, reason: str) -> None:
        """The requests at `worker` stop waiting for it, as if it had failed: its answers would be wrong (`reason`).
        Each goes to another engine if none of its answer reached the client yet, and is aborted there by rid."""
        self._attempts.interrupt(worker, reason)

    async def forward(
        self,
        routing: RoutingRequest,
        body: bytes,
        headers: Mapping[str, str],
        method: str = "POST",
        arrived_at: float | None = None,
        on_answer: AnswerReader | None = None,
        client_gone: asyncio.Future[None] | None = None,
        rids: tuple[str, ...] = (),
    ) -> EngineResponse:
        """Sends `body` to `routing.route` on an engine the policy picks; returns its answer, to be relayed.

        `rids`, those the body names, abort the request at an engine that may still run it when it is given up;
        `arrived_at` (time.perf_counter() when the body was read) times the router's own part;
        `on_answer` reads the complete answer of the one attempt whose answer reached the client;
        `client_gone`, done once the client has left, ends the request with ClientGone and aborts it at its engine.
        A client's /abort_request that names the request before it is written to an engine ends it with
        RequestAborted (`held_requests`).
        """
        deadline = time.monotonic() + self._request_timeout
        forwarded = forwardable_headers(headers)
        tokens = min(routing.tokens, MAX_COUNTED_TOKENS) if routing.body else 0
        tried: set[str] = set()
        retries = 0
        attempt: Attempt | None = None

        def client_left(_: object) -> None:
            if attempt is not None:
                attempt.interrupt.fire(ClientGone("the client closed its connection"))

        if client_gone is not None:
            if client_gone.done():
                raise ClientGone("the client closed its connection before its request was sent")
            client_gone.add_done_callback(client_left)  # a callback, not a task: nothing runs until the client leaves
        generates = method != "GET"
        # Only a generation request is aborted by a client's /abort_request; a question (GET) is never marked.
        held = self.held.hold(rids) if generates else HeldRequest(rids)
        # What ends the router's own waits (the stagger, a retry's backoff, the abort of an earlier attempt).
        stops = (held.aborted,) if client_gone is None else (held.aborted, client_gone)
        try:
            while True:
                held.check()
                worker = self._choose(routing, tried, generates=generates)
                if arrived_at is not None and not tried:
                    self._metrics.added_latency.observe(time.perf_counter() - arrived_at)
                tried.add(worker.id)
                if retries and rids:  # back at an engine that may still be aborting an earlier attempt's rids
                    await self._aborts.settle(worker, rids, deadline - time.monotonic(), stops)
                    held.check()
                    if client_gone is not None and client_gone.done():
                        raise ClientGone(f"the client closed its connection while {routing.route} waited for a retry")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(f"{routing.route} ran out of time before an engine answered")
                if not worker.healthy or not self._workers.contains(worker):
                    continue  # it left routing while the retry waited there: another engine, the same attempt
                attempt = self._attempts.start(worker, tokens, rids)
                held.attach(attempt.interrupt, self._aborts_at_engine(attempt))
                last_try = retries >= self._retry.max_retries
                try:
                    if stagger := self._stagger.delay(worker.id, routing.prompt_key, attempt):
                        await self._wait_to_send(attempt, min(stagger, remaining), held, stops)
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            attempt.end()
                            raise DeadlineExceeded(f"{routing.route} ran out of time before it was sent to an engine")
                    return await self._send(attempt, method, routing, body, forwarded, remaining, last_try, on_answer)
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
                await asyncio.wait(stops, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                held.check()
                if client_gone is not None and client_gone.done():
                    raise ClientGone(f"the client closed its connection while {routing.route} waited for a retry")
        finally:
            self.held.release(held)
            if client_gone is not None:
                client_gone.remove_done_callback(client_left)

    async def _wait_to_send(
        self, attempt: Attempt, secs: float, held: HeldRequest, stops: tuple[asyncio.Future[None], ...]
    ) -> None:
        """Holds `attempt` back `secs` (its engine's load counts it meanwhile, so routing sees it there), or until one
        of `stops` is done (its client left, or an abort named it). An attempt interrupted meanwhile ends unsent:
        RequestAborted, ClientGone, or RetryableFailure when its engine failed or left routing (nothing to abort
        there)."""
        self._metrics.prefill_staggers.inc()
        try:
            await asyncio.wait(stops, timeout=secs, return_when=asyncio.FIRST_COMPLETED)
            held.check()
        except BaseException:
            attempt.end()
            raise
        error = attempt.interrupt.error
        if error is None and not (attempt.worker.healthy and self._workers.contains(attempt.worker)):
            error = EngineFailed(f"{attempt.worker.url} left routing while a request waited to be sent there")
        if error is not None:
            attempt.end()
            if isinstance(error, EngineFailed):
                raise RetryableFailure(str(error))
            raise error

    def _choose(self, routing: RoutingRequest, tried: set[str], generates: bool) -> Worker:
        healthy = self._workers.healthy()
        if not healthy:
            raise NoHealthyEngine(len(self._workers.all()))
        # Prefer engines not tried yet; with all of them tried, any healthy one may have recovered.
        untried = [w for w in healthy if w.id not in tried]
        if not generates:
            # A question any engine answers (its model, its server): to the least busy one, outside the policy, which
            # counted each as a routing decision and as traffic it had sent there (polled /v1/models skewed both).
            return min(untried or healthy, key=lambda w: w.in_flight)
        if untried and len(untried) < len(healthy):
            # A retry offered the engines left: the policy learns that those it failed at are still in routing.
            routing = replace(routing, excluded=frozenset(w.id for w in healthy if w.id in tried))
        choice = self._policy.select(untried or healthy, routing)
        self._metrics.routing_decision(choice.reason).inc()
        return choice.worker

    async def _send(
        self,
        attempt: Attempt,
        method: str,
        routing: RoutingRequest,
        body: bytes,
        headers: dict[str, str],
        remaining: float,
        last_try: bool,
        on_answer: AnswerReader | None = None,
    ) -> EngineResponse:
        """The engine's answer, read up to where it is committed to (a plain answer whole, a stream's first piece).

        RetryableFailure for a connection failure, a failed engine, or a 5xx unless `last_try`; the attempt ends
        with any error, and a request given up while the engine may still run it is aborted there.
        """
        client = self._client
        if client is None:
            attempt.end()
            raise Unavailable("the router is not serving yet (its engine connections are not open)")
        worker = attempt.worker
        route = routing.route
        upstream: EngineAnswer | None = None
        # The whole answer is bounded by the time left: the client's bound on the entire request.
        connect = min(self._connect_timeout, remaining)
        try:
            upstream = await client.request(
                method, worker.url, route, body, headers, connect, remaining, attempt.interrupt
            )
            if upstream.status >= 500:
                self._metrics.engine_errors.inc(worker.url, "http_5xx")
                if not last_try:
                    raise RetryableFailure(f"{worker.url}: HTTP {upstream.status}")
            length = upstream.content_length
            whole = length is not None and length <= self._max_whole_answer
            first = await upstream.read() if whole else await upstream.read_chunk()
        except EngineConnectionError as exc:
            # A connection lost once the request was written may leave the request running at the engine.
            lost = isinstance(exc, EngineConnectionLost)
            self._give_up(attempt, upstream, "its connection was lost" if lost else "")
            if isinstance(exc, EngineConnectTimeout) and connect < self._connect_timeout:
                # The connect ran out of the request's time, not of the engine's: nothing to hold against the engine.
                # (Told by the error, not by the clock: the event loop's timers may fire a little before
                # time.monotonic() reaches their deadline, uvloop's by up to a millisecond.)
                raise DeadlineExceeded(f"{route} ran out of time while connecting to {worker.url}") from exc
            self._metrics.engine_errors.inc(worker.url, "connection")
            reason = f"{worker.url}: {describe_error(exc)}"
            self._workers.record_failure(worker, reason)
            raise RetryableFailure(reason) from exc
        except EngineFailed as exc:
            self._give_up(attempt, upstream, "its engine failed")
            self._metrics.engine_errors.inc(worker.url, "engine_failed")
            raise RetryableFailure(str(exc)) from exc
        except EngineReadTimeout as exc:  # the engine has the request: resending it elsewhere would double it
            self._give_up(attempt, upstream, "past its deadline")
            raise DeadlineExceeded(f"{worker.url} did not answer {route} in time ({describe_error(exc)})") from exc
        except ClientGone:
            self._give_up(attempt, upstream, "its client left")
            raise
        except BaseException:  # a 5xx to retry, or a cancellation
            self._give_up(attempt, upstream)
            raise
        if whole:
            # Ended before the client has the answer, so a client that sends its next request on receipt
            # already finds this engine's load decremented.
            attempt.end()
            upstream.release()
        # The prompt tokens an engine reports for one text prompt teach the router the engines' tokenizer.
        chars = routing.single_text_chars
        on_usage = None if chars is None else lambda usage: self._chars_per_token.observe(chars, usage.prompt_tokens)
        return EngineResponse(
            upstream, attempt, first, whole, self._workers, self._metrics, self._abort, on_answer, on_usage, route
        )

    def _aborts_at_engine(self, attempt: Attempt) -> AbortAtEngine:
        """How a client's abort that may have missed `attempt` at its engine, or named part of its batch, is sent
        there again (`held_requests`)."""

        def abort_at(rids: tuple[str, ...], at: float) -> None:
            if self._client is not None:
                self._aborts.send_at(self._client, attempt, rids, at, "its client aborted it")

        return abort_at

    def _give_up(self, attempt: Attempt, upstream: EngineAnswer | None, why: str = "") -> None:
        """Ends `attempt` and drops its connection; with `why`, also asks the engine to abort the request by rid."""
        attempt.end()
        if upstream is not None:
            upstream.close()
        if why:
            self._abort(attempt, why)

    def _abort(self, attempt: Attempt, why: str) -> None:
        """Asks the engine of `attempt`, ended, to abort its request by rid (in the background)."""
        if self._client is not None:
            self._aborts.send(self._client, attempt, why)
