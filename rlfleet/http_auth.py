"""Bearer-token checking for a FastAPI app, as a bare ASGI middleware in front of its routes.

A middleware rather than a route dependency so that no endpoint added later is left open by
mistake: everything is guarded except the paths and methods named open. Refusals are answered
with 401, the body shape of `rlfleet.http_errors` and `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from rlfleet.api_token import ApiTokenGuard
from rlfleet.errors import Unauthenticated
from rlfleet.http_errors import error_response

# Probes and scrapes carry no token: Kubernetes and Prometheus must reach them.
OPEN_PATHS = ("/health", "/liveness", "/metrics")
WS_POLICY_VIOLATION = 1008
"""The close code (RFC 6455) a websocket without the token is refused with: every scope but lifespan is guarded, so
a websocket route added later is not left open either."""


class BearerTokenMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        guard: ApiTokenGuard,
        open_paths: frozenset[str],
        open_methods: frozenset[str],
        guarded_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.guard = guard
        self.open_paths = open_paths
        self.open_methods = open_methods
        self.guarded_paths = guarded_paths

    def _open(self, scope: Scope) -> bool:
        path = scope["path"]
        return path in self.open_paths or (scope["method"] in self.open_methods and path not in self.guarded_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan" or (kind == "http" and self._open(scope)):
            await self.app(scope, receive, send)
            return
        try:
            self.guard.check(Headers(scope=scope).get("authorization"), "http")
        except Unauthenticated as exc:
            if kind == "websocket":  # refused before the handshake: the client gets 403, and no route runs
                await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": str(exc)[:120]})
                return
            response = error_response(exc)
            response.headers["WWW-Authenticate"] = 'Bearer realm="rlfleet"'
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def require_api_token(
    app: FastAPI,
    guard: ApiTokenGuard,
    *,
    open_paths: Iterable[str] = OPEN_PATHS,
    open_methods: Iterable[str] = (),
    guarded_paths: Iterable[str] = (),
) -> None:
    """Guards every route of `app` but `open_paths` and requests with `open_methods` (e.g. GET), except those to
    `guarded_paths` (a GET that changes state, as SGLang's GET /flush_cache).

    Add it before middlewares that must stay in front of it (the router's generation relay).
    """
    if guard.enabled:
        app.add_middleware(
            BearerTokenMiddleware,
            guard=guard,
            open_paths=frozenset(open_paths),
            open_methods=frozenset(m.upper() for m in open_methods),
            guarded_paths=frozenset(guarded_paths),
        )
