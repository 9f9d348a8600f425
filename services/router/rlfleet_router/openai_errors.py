"""The router's own errors on the OpenAI routes, in OpenAI's error shape.

OpenAI clients read an error as `{"error": {"message", "type", "param", "code"}}`, whether it is a plain answer
or an SSE event of a stream cut short (SGLang's OpenAI server writes its stream errors so too). On
/v1/completions and /v1/chat/completions the router's error body therefore carries `type` and `param` beside
its own `kind`, `message` and `code`; every other route keeps the router's shape (`rlfleet.http_errors`).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from rlfleet.errors import RlfleetError, Unauthenticated
from rlfleet.http_errors import error_body

OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def openai_error_type(error: RlfleetError) -> str:
    """OpenAI's error type for `error`: what the client must change, or a fault on the serving side."""
    if isinstance(error, Unauthenticated):
        return "authentication_error"
    return "invalid_request_error" if error.http_status < 500 else "server_error"


def route_error_body(route: str, error: RlfleetError) -> dict[str, dict[str, object]]:
    """`error` as the body (or SSE event) of an answer on `route`."""
    body = error_body(error)
    if route in OPENAI_ROUTES:
        body["error"].update(type=openai_error_type(error), param=None)
    return body


def route_error_response(route: str, error: RlfleetError) -> JSONResponse:
    return JSONResponse(route_error_body(route, error), status_code=error.http_status)
