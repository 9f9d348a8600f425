"""Maps rlfleet errors (and request-validation failures) to HTTP responses, once for every app.

Body shape: `{"error": {"kind": "invalid_input", "message": "...", "code": 400}}`. Internal faults
are logged with their stack trace and answered with a generic 500 body.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlfleet.errors import Internal, InvalidInput, RlfleetError

logger = logging.getLogger(__name__)


def error_body(error: RlfleetError) -> dict[str, dict[str, object]]:
    return {"error": {"kind": error.kind, "message": str(error), "code": error.http_status}}


def error_response(error: RlfleetError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.http_status)


def describe_validation_error(exc: RequestValidationError) -> str:
    """One line per problem, each naming the field by its path (`body.items.0.label: ...`)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RlfleetError)
    async def _rlfleet_error(request: Request, exc: RlfleetError) -> JSONResponse:
        if isinstance(exc, Internal) or exc.http_status >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidInput(describe_validation_error(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(Internal("internal error; see the service log"))
