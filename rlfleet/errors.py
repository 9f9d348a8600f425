"""The one error hierarchy of rlfleet.

Cores raise these; the HTTP layer (`rlfleet.http_errors`) and the gRPC layer
(`rlfleet.grpc_errors`) map them once to status codes. Messages are meant for the caller: they
name the field or thing that is wrong and, where possible, how to fix it.
"""

from __future__ import annotations


class RlfleetError(Exception):
    """Base of every error rlfleet reports to a caller."""

    http_status = 500
    grpc_code = "INTERNAL"
    kind = "internal"


class InvalidInput(RlfleetError):
    """The request is malformed or names something impossible; retrying will not help."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    kind = "invalid_input"


class NotFound(RlfleetError):
    http_status = 404
    grpc_code = "NOT_FOUND"
    kind = "not_found"


class MethodNotAllowed(RlfleetError):
    """The path exists, but not for this HTTP method (the response's Allow header names those it has)."""

    http_status = 405
    grpc_code = "UNIMPLEMENTED"
    kind = "method_not_allowed"


class Unauthenticated(RlfleetError):
    """The request lacks the API token the service requires, or carries a wrong one."""

    http_status = 401
    grpc_code = "UNAUTHENTICATED"
    kind = "unauthenticated"


class Conflict(RlfleetError):
    """The request contradicts the current state (e.g. cancelling a finished run)."""

    http_status = 409
    grpc_code = "FAILED_PRECONDITION"
    kind = "conflict"


class AlreadyExists(Conflict):
    """What the request would create already exists (e.g. a Submit's request_id already made a run, from another
    spec); no retry of the request can succeed."""

    grpc_code = "ALREADY_EXISTS"
    kind = "already_exists"


class ResourceExhausted(RlfleetError):
    """Too large or too many; retry with less."""

    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"
    kind = "resource_exhausted"


class Unavailable(RlfleetError):
    """A dependency is down or overloaded; retrying later may succeed."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    kind = "unavailable"


class DeadlineExceeded(RlfleetError):
    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"
    kind = "deadline_exceeded"


class Internal(RlfleetError):
    """A fault of ours; the caller sees only that it happened, the log has the details."""
