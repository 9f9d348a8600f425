"""The hub's REST face: POST /score, POST /validate and GET /functions in the protobuf JSON mapping, /health,
/metrics."""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from google.protobuf.message import Message
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from rlfleet.client_gone import ClientGone, unless_client_leaves
from rlfleet.errors import InvalidInput, ResourceExhausted, RlfleetError, Unavailable
from rlfleet.http_errors import error_body, install_error_handlers, is_json_media_type
from rlfleet.proto_parse_errors import misshapen_field
from rlfleet.v1 import reward_pb2
from rlfleet_reward.admission import RETRY_AFTER_SECONDS, Overloaded
from rlfleet_reward.metrics import RewardMetrics
from rlfleet_reward.scoring import Scorer

M = TypeVar("M", bound=Message)
# A body past this is parsed on a thread: 60 MB of items took 6 s to parse, and on the event loop held up every
# other request (and /health past its probe's timeout); a thread gives the loop the interpreter every few ms.
PARSE_OFF_LOOP_BYTES = 1 << 20


def _json_response(message: Message) -> Response:
    # Zero-valued fields stay in, so a client reads `"score": 0.0` rather than a missing key.
    body = json_format.MessageToJson(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True, indent=None
    )
    return Response(body, media_type="application/json")


def _require_json(request: Request) -> None:
    """InvalidInput unless the body is declared JSON, as the Runs API requires. A body of any type was read as JSON,
    so a web page could POST one across sites without the browser asking the hub first (text/plain, a form, a body
    with no type): any site a user of a hub on localhost visited could make it run programs in its `code` sandbox."""
    content_type = request.headers.get("content-type")
    if content_type is None or not is_json_media_type(content_type):
        sent = f"the request's Content-Type is {content_type!r}" if content_type else "the request has no Content-Type"
        raise InvalidInput(f"body: not read as JSON: {sent}; send it with Content-Type: application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes whether or not Content-Length is declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ResourceExhausted(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ResourceExhausted(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# Past this many digits an integer is beyond any double (1.8e308 has 309).
_MAX_INT_DIGITS = 300


def _json_int(text: str) -> int | float:
    # Every number these messages hold is a double. An integer too long for one reads as an exponent does, as
    # infinity, which the spec checks refuse naming the field; as an int it would overflow the conversion to a
    # double, or pass int's limit on digits, both outside what the parser reports.
    return int(text) if len(text) <= _MAX_INT_DIGITS else float(text)


def parse_request(body: bytes, message: M) -> M:
    """`message` filled from the JSON mapping in `body`; unknown fields and wrong types are InvalidInput naming them."""
    kind = type(message).__name__
    try:
        document = json.loads(body, parse_int=_json_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        # The decoder recurses once per level; protobuf refuses far shallower nesting anyway ("too deep").
        raise InvalidInput("request body nests arrays or objects too deeply to read") from None
    if not isinstance(document, dict):
        raise InvalidInput(f"request body must be a JSON object (a {kind}), got {type(document).__name__}")
    if problem := misshapen_field(document, message.DESCRIPTOR):  # true for a weight read as 1.0, among others
        raise InvalidInput(f"invalid {kind}: {problem}")
    try:
        return json_format.ParseDict(document, message)
    except json_format.ParseError as exc:
        raise InvalidInput(f"invalid {kind}: {exc}") from None


def create_app(scorer: Scorer, metrics: RewardMetrics, max_request_bytes: int) -> FastAPI:
    app = FastAPI(title="rlfleet reward hub")
    install_error_handlers(app)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return JSONResponse(error_body(exc), status_code=exc.http_status, headers=headers)

    @app.post("/score")
    async def score(request: Request) -> Response:
        try:
            _require_json(request)
            body = await _read_body(request, max_request_bytes)
            if len(body) > PARSE_OFF_LOOP_BYTES:
                message = await asyncio.to_thread(parse_request, body, reward_pb2.ScoreRequest())
            else:
                message = parse_request(body, reward_pb2.ScoreRequest())
        except ClientDisconnect:  # the client left before its body was in: nobody to answer, no fault of ours
            metrics.requests.labels("cancelled").inc()
            return Response(status_code=499)
        except Exception as exc:  # refused before scoring: counted as the scorer counts its refusals
            metrics.requests.labels(exc.kind if isinstance(exc, RlfleetError) else "internal").inc()
            raise
        try:
            scored = await unless_client_leaves(request, scorer.score(message))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; 499 is what proxies log for a client that left
        return _json_response(scored)

    @app.post("/validate")
    async def validate(request: Request) -> Response:
        _require_json(request)
        try:
            body = await _read_body(request, max_request_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        if len(body) > PARSE_OFF_LOOP_BYTES:
            message = await asyncio.to_thread(parse_request, body, reward_pb2.ValidateSpecRequest())
        else:
            message = parse_request(body, reward_pb2.ValidateSpecRequest())
        return _json_response(scorer.validate_spec(message))

    @app.get("/functions")
    async def functions() -> Response:
        return _json_response(scorer.list_functions())

    @app.get("/health")
    async def health() -> dict[str, object]:
        pool = scorer.pool
        if pool.down is not None:
            raise Unavailable(str(pool.down))  # a fresh one: raised again, one error would grow its traceback
        if pool.live == 0:  # all died a moment ago; new ones are starting
            raise Unavailable("no live reward worker processes")
        return {"status": "ok", "workers": pool.live, "busy_workers": pool.busy, "functions": list(scorer.registry)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
