"""Maps rlfleet errors (and request-validation failures, and the routing errors of the framework: no such
path, method not allowed) to HTTP responses, once for every app.

Body shape: `{"error": {"kind": "invalid_input", "message": "...", "code": 400}}`. Internal faults
are logged with their stack trace and answered with a generic 500 body.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from rlfleet.errors import (
    Conflict,
    Internal,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unauthenticated,
    Unavailable,
)

logger = logging.getLogger(__name__)


def error_body(error: RlfleetError) -> dict[str, dict[str, object]]:
    return {"error": {"kind": error.kind, "message": str(error), "code": error.http_status}}


def error_response(error: RlfleetError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.http_status)


def is_json_media_type(content_type: str) -> bool:
    """`application/json`, with or without parameters, or a `+json` type."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


# pydantic's error types for a value that is not a mapping where a model or dict was expected.
NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type"})
JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def whole_body_problem(
    exc: RequestValidationError, content_type: str | None, missing_reads_as_json: bool = False
) -> str | None:
    """What to say when the body as a whole is not an object, which pydantic's own words ("Input should be a
    valid dictionary ...") leave a puzzle; else None. Most often it was not sent as JSON: `curl -d` sends form
    data's Content-Type. `missing_reads_as_json`: the app reads a body without a Content-Type as JSON
    (FastAPI's strict_content_type=False)."""
    whole = [err for err in exc.errors() if tuple(err.get("loc", ())) == ("body",) and err.get("type") in NOT_AN_OBJECT]
    if not whole:
        return None
    if not (is_json_media_type(content_type) if content_type else missing_reads_as_json):
        sent = f"the request's Content-Type is {content_type!r}" if content_type else "the request has no Content-Type"
        return f"body: not read as JSON: {sent}; send it with Content-Type: application/json"
    value = whole[0].get("input")
    got = "null" if value is None else JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    return f"body: must be a JSON object, got {got}"


def describe_validation_error(exc: RequestValidationError, content_type: str | None = None) -> str:
    """One line per problem, each naming the field by its path (`body.items.0.label: ...`), or what is wrong
    with the body as a whole (`content_type`: the request's)."""
    if whole := whole_body_problem(exc, content_type):
        return whole
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


_BY_STATUS: dict[int, type[RlfleetError]] = {
    cls.http_status: cls
    for cls in (InvalidInput, Unauthenticated, NotFound, MethodNotAllowed, Conflict, ResourceExhausted, Unavailable)
}


def framework_error_body(request: Request, exc: HTTPException) -> dict[str, dict[str, object]]:
    """The framework's own HTTP errors (no such path, method not allowed: raised before any handler of
    ours runs) in the API's error format, with their status code."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"{where}: no such path"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "none")
        message = f"{where}: method not allowed; this path takes {allowed}"
    else:
        message = f"{where}: {exc.detail}"
    kind = _BY_STATUS.get(exc.status_code, InvalidInput if exc.status_code < 500 else Internal).kind
    return {"error": {"kind": kind, "message": message, "code": exc.status_code}}


def allowed_methods(app: FastAPI, request: Request) -> str:
    """The methods the routes of the request's path take, together ("" if none does). The framework's 405 names
    only those of the path's first route: GET /v1/runs lists runs, yet a PUT there was told the path takes POST."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, BaseRoute) and route.matches(request.scope)[0] is Match.PARTIAL:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RlfleetError)
    async def _rlfleet_error(request: Request, exc: RlfleetError) -> JSONResponse:
        if isinstance(exc, Internal) or exc.http_status >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 405 and (allowed := allowed_methods(app, request)):
            exc.headers = {**(exc.headers or {}), "Allow": allowed}
        return JSONResponse(framework_error_body(request, exc), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidInput(describe_validation_error(exc, request.headers.get("content-type"))))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(Internal("internal error; see the service log"))
