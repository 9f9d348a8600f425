"""The fleet's API token: read once from a file (a mounted secret), checked in constant time.

The token guards the Runs API (REST and gRPC) and the router's admin endpoints. Services and the
clients that call those endpoints read the same file: `api_token_file` in a service's settings
(`RLFLEET_<SVC>_API_TOKEN_FILE`), `RLFLEET_API_TOKEN_FILE` or `RLFLEET_API_TOKEN` for the CLI.
Compose and Helm mount a generated token and set these by default. A service given no token file
serves every endpoint open, as a laptop fleet bound to 127.0.0.1 does.

Transports use it through `rlfleet.http_auth` (an ASGI middleware) and `rlfleet.grpc_auth` (a server
interceptor); both count refusals in `rlfleet_<service>_unauthenticated_requests_total`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from rlfleet.errors import InvalidInput, Unauthenticated

logger = logging.getLogger(__name__)

TOKEN_ENV = "RLFLEET_API_TOKEN"
TOKEN_FILE_ENV = "RLFLEET_API_TOKEN_FILE"
_SCHEME = "bearer"
# A token file others may read leaks the token; one its group or others may write lets them set it. A group may
# read it: Kubernetes mounts the Secret 0440 for the pod's fsGroup.
_EXPOSURES = (
    (stat.S_IROTH, "any user can read it"),
    (stat.S_IWOTH, "any user can change it"),
    (stat.S_IWGRP, "its group can change it"),
)


def read_token_file(path: str | Path | None) -> str | None:
    """The token in `path` (surrounding whitespace dropped); None when no path is configured."""
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidInput(f"api_token_file: cannot read the API token from {path}: {exc.strerror or exc}") from exc
    if not token:
        raise InvalidInput(f"api_token_file: {path} is empty; write the token into it or unset api_token_file")
    mode = Path(path).stat().st_mode
    exposed = [what for bit, what in _EXPOSURES if mode & bit]
    if exposed:
        logger.warning(
            "api_token_file: %s has mode %s: %s; chmod it 0400 (0440 for a group that needs it)",
            path,
            oct(stat.S_IMODE(mode)),
            ", ".join(exposed),
        )
    return token


def client_token(env: Mapping[str, str] = os.environ) -> str | None:
    """The token a client sends: RLFLEET_API_TOKEN_FILE's content, else RLFLEET_API_TOKEN, else none."""
    if env.get(TOKEN_FILE_ENV):
        return read_token_file(env[TOKEN_FILE_ENV])
    return env.get(TOKEN_ENV) or None


def bearer_headers(token: str | None) -> dict[str, str]:
    """The Authorization header carrying `token`, or no header without one."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class ApiTokenGuard:
    """Accepts a request only if its Authorization value is `Bearer <token>`; open without a token."""

    def __init__(self, token: str | None, registry: CollectorRegistry, service: str) -> None:
        self._expected = hashlib.sha256(token.encode()).digest() if token else None
        self._service = service
        self.rejected = Counter(
            f"rlfleet_{service}_unauthenticated_requests",
            "Requests refused for a missing or wrong API token, by transport (http, grpc).",
            ["transport"],
            registry=registry,
        )
        for transport in ("http", "grpc"):
            self.rejected.labels(transport=transport)
        if self._expected is None:
            logger.warning("%s: no API token configured: the endpoints it would guard are open to anyone", service)

    @classmethod
    def from_file(cls, path: str | Path | None, registry: CollectorRegistry, service: str) -> ApiTokenGuard:
        return cls(read_token_file(path), registry, service)

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def check(self, authorization: str | None, transport: str) -> None:
        """Raises Unauthenticated unless `authorization` carries the token (or no token is required)."""
        if self._expected is None:
            return
        problem = _problem(authorization, self._expected)
        if problem:
            self.rejected.labels(transport=transport).inc()
            raise Unauthenticated(f"{self._service}: {problem}")


def _problem(authorization: str | None, expected: bytes) -> str:
    if not authorization:
        return "this endpoint needs the API token: send the header 'Authorization: Bearer <token>'"
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != _SCHEME or not credentials.strip():
        return "the Authorization header must read 'Bearer <token>'"
    # Digests of equal length, compared in constant time: the time taken tells nothing of the token.
    if not hmac.compare_digest(hashlib.sha256(credentials.strip().encode()).digest(), expected):
        return "wrong API token"
    return ""
