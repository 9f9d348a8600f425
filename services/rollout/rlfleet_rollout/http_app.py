"""The REST Runs API over RunsCore: protobuf JSON in and out, errors mapped once by rlfleet.http_errors.

POST /v1/runs               body: RunSpec JSON            -> Run
                           ?validate_only=true: every check, nothing stored -> the Run it would create, no id
                           ?request_id=<uuid>: a repeat answers the run the first made (409 for another spec)
GET  /v1/runs               ?state=&page_size=&page_token= -> ListRunsResponse
GET  /v1/runs/{id}                                         -> Run
POST /v1/runs/{id}:cancel                                  -> Run (GET: 405, Allow: POST)
GET  /v1/runs/{id}:watch    server-sent events, `data: <Run JSON>` with the run now, then with its latest state after
                           each change (changes back to back may come as one), until the run ends, and a
                           `: keep-alive` comment after each `watch_keepalive_s` without a change; the stream
                           also ends, after a `: watch ended: <why>` comment, when the orchestrator shuts down,
                           loses Redis or the run's record (a client watches again). The event of the run's
                           end has `id: end`; a watch sent `Last-Event-ID: end` (a browser's EventSource
                           reconnecting after it) of a run that ended is answered 204, which stops the reconnects.
                           An event's data is the Run alone (gRPC's RunEvent.run, without its message and time)
GET  /liveness                                             -> 200 while the process serves (Redis or not)
GET  /health                                               -> 200 once Redis answers, else 503 (readiness), within
                                                              HEALTH_TIMEOUT_S
GET  /metrics
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from google.protobuf.message import Message
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from starlette.exceptions import HTTPException

from rlfleet.api_token import ApiTokenGuard
from rlfleet.errors import InvalidInput, RlfleetError, Unavailable
from rlfleet.http_auth import require_api_token
from rlfleet.http_errors import install_error_handlers
from rlfleet.http_limits import limit_request_body
from rlfleet.proto_parse_errors import parse_json_message
from rlfleet.v1.runs_pb2 import RunEvent, RunSpec, RunState
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_events import is_terminal
from rlfleet_rollout.runs_core import RunsCore, unknown_state
from rlfleet_rollout.sse_keepalive import with_keepalive

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 3.0
"""Bound on /health's ping of Redis, inside a readiness probe's timeout (5 s in the chart): two tries of at most half
of it each, the second at once and only for a connection found broken (Redis closed it, e.g. it restarted)."""


def health_client(url: str) -> aioredis.Redis:
    """The Redis client /health pings with, bounded by HEALTH_TIMEOUT_S. The run records' client retries a lost
    connection for 30 s (a Redis restart), which a probe would not wait for."""
    each = HEALTH_TIMEOUT_S / 2
    return aioredis.Redis.from_url(url, socket_timeout=each, socket_connect_timeout=each, retry=Retry(NoBackoff(), 1))


def to_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


# The id of a watch's last event, the run's end. A browser's EventSource reconnects whenever a stream ends, sending
# the last id it saw; a stream ended by the run is answered 204 then, which is what stops it reconnecting.
END_EVENT_ID = "end"


def sse_event(event: RunEvent) -> str:
    """The event's run as one SSE event. Its data is the Run, not the RunEvent gRPC's Watch sends: every release's
    `rlfleet watch` (RunsClient.watch) and the clients the README documents read each `data:` line as a Run, and
    would read a RunEvent as an empty run (its fields are none of a Run's). The message a RunEvent adds says what
    changed since the previous event, which a client finds by comparing the two runs; its time is when it was sent."""
    end = f"id: {END_EVENT_ID}\n" if is_terminal(event.run.state) else ""
    return f"{end}data: {json.dumps(to_json(event.run))}\n\n"


def sse_ended(error: RlfleetError) -> str:
    """The line that ends a watch stream the run did not end, naming why: a comment, which SSE clients skip (the data
    of an event would reach `rlfleet watch` as a Run: RunsClient.watch reads every `data:` line as one), on one line
    (a line break would end the comment)."""
    why = " ".join(str(error).splitlines())
    return f": watch ended: {why}\n\n"


def parse_run_spec(body: bytes) -> RunSpec:
    """The RunSpec of a request body; InvalidInput naming the field for anything else."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"body: malformed JSON: {exc}") from None
    except RecursionError:
        # json's decoder recurses per array or object level; a RunSpec is a few levels deep.
        raise InvalidInput("body: nested too deeply to parse (a RunSpec is a few levels deep)") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"body: must be a JSON object holding a RunSpec, got {type(data).__name__}")
    return parse_json_message(data, RunSpec(), "body")


def parse_state(value: str) -> RunState:
    """`QUEUED`, `queued` or `RUN_STATE_QUEUED`; empty means every state."""
    if not value:
        return RunState.RUN_STATE_UNSPECIFIED
    name = value.upper()
    name = name if name.startswith("RUN_STATE_") else f"RUN_STATE_{name}"
    if name not in RunState.keys() or name == "RUN_STATE_UNSPECIFIED":
        raise unknown_state(value)
    return RunState.Value(name)


def check_query(request: Request, takes: tuple[str, ...] = ()) -> None:
    """InvalidInput naming a query parameter the route does not take, or one given twice: a misspelt filter
    (`stat=RUNNING`, `pageSize=5`) would be ignored and a misspelt flag (`validateOnly`) would turn a check
    into a real run."""
    route = f"{request.method} {request.scope['route'].path}"
    for name in sorted(set(request.query_params)):
        if name not in takes:
            raise InvalidInput(f"query.{name}: not a parameter of {route} (it takes {', '.join(takes) or 'none'})")
        if len(request.query_params.getlist(name)) > 1:
            raise InvalidInput(f"query.{name}: given more than once")


def build_app(
    core: RunsCore,
    metrics: RolloutMetrics,
    redis_client: aioredis.Redis,
    guard: ApiTokenGuard,
    *,
    watch_keepalive_s: float,
) -> FastAPI:
    """`redis_client` is what /health pings (`health_client`)."""
    app = FastAPI(title="rlfleet rollout orchestrator", version="1")
    install_error_handlers(app)
    limit_request_body(app)
    require_api_token(app, guard)  # added last, so it runs first: strangers are refused before anything else

    @app.post("/v1/runs")
    async def submit(request: Request, validate_only: bool = False, request_id: str = "") -> JSONResponse:
        check_query(request, ("validate_only", "request_id"))
        if "request_id" in request.query_params and not request_id:
            raise InvalidInput("query.request_id: empty; leave it out to submit without one")
        spec = parse_run_spec(await request.body())
        run = await core.submit(spec, validate_only=validate_only, request_id=request_id)
        return JSONResponse(to_json(run))

    @app.get("/v1/runs")
    async def list_runs(request: Request, state: str = "", page_size: int = 0, page_token: str = "") -> JSONResponse:
        check_query(request, ("state", "page_size", "page_token"))
        return JSONResponse(to_json(await core.list(parse_state(state), page_size, page_token)))

    # Registered before GET /v1/runs/{run_id}, which would otherwise take `id:watch` for a run id.
    @app.get("/v1/runs/{run_id}:watch")
    async def watch(request: Request, run_id: str) -> Response:
        check_query(request)
        watched = core.watch(run_id)
        first = await anext(watched)  # before the response starts: a missing run is a 404, not a stream
        if is_terminal(first.run.state) and request.headers.get("last-event-id") == END_EVENT_ID:
            await watched.aclose()
            return Response(status_code=204)  # the client saw the run end: nothing more will come

        async def events() -> AsyncIterator[str]:
            yield sse_event(first)
            try:
                async for event in watched:
                    yield sse_event(event)
            except RlfleetError as exc:
                # An SSE stream has no status to end with once it has started: it ends, and a client that sees it
                # end before the run did watches again (rlfleet watch does, with backoff), answered with the
                # error's status then (404 for a run deleted, 503 while Redis is away).
                logger.info("watch of run %s ended: %s", run_id, exc, extra={"run_id": run_id})
                yield sse_ended(exc)

        return StreamingResponse(
            with_keepalive(events(), watch_keepalive_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    # Registered before GET /v1/runs/{run_id} too, which would answer a cancel sent as GET with "run 'x:cancel'
    # not found".
    @app.get("/v1/runs/{run_id}:cancel")
    async def cancel_by_get(run_id: str) -> JSONResponse:
        raise HTTPException(status_code=405, headers={"Allow": "POST"})

    @app.get("/v1/runs/{run_id}")
    async def get(request: Request, run_id: str) -> JSONResponse:
        check_query(request)
        return JSONResponse(to_json(await core.get(run_id)))

    @app.post("/v1/runs/{run_id}:cancel")
    async def cancel(request: Request, run_id: str) -> JSONResponse:
        check_query(request)
        return JSONResponse(to_json(await core.cancel(run_id)))

    # Liveness asks nothing of Redis: the orchestrator waits out a Redis outage (redis_outage.py),
    # which a restart would not end sooner. Readiness (/health) does, to keep traffic away meanwhile.
    @app.get("/liveness")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        try:
            await redis_client.ping()
        except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
            raise Unavailable(f"redis unreachable: {exc}") from exc
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
