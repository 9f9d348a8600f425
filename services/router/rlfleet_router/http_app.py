"""The router's HTTP API: a thin FastAPI layer over `Fleet`.

Engine-facing routes keep SGLang's paths and shapes (`/generate`, `/v1/completions`,
`/v1/chat/completions`, `/update_weights_from_disk`, `/get_model_info`, ...); control requests
(`/abort_request`, `/pause_generation`, `/continue_generation`, `/flush_cache`) go to every engine;
membership follows sglang-router's worker API (`/workers`, and the older `/add_worker`, `/remove_worker`,
`/list_workers`); the fleet's own state is at `/fleet` and
`/weight_version`; cached multi-turn trajectories at `/trajectories/{id}`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from rlfleet.api_token import ApiTokenGuard
from rlfleet.http_auth import require_api_token
from rlfleet.http_errors import install_error_handlers
from rlfleet.http_limits import BodySizeLimitMiddleware
from rlfleet_router.api_models import UpdateWeightsRequest
from rlfleet_router.config import RouterConfig
from rlfleet_router.engine_controls import FLUSH_ROUTE
from rlfleet_router.fanout import FANOUT_ROUTES
from rlfleet_router.fleet import Fleet, parse_json_object
from rlfleet_router.generation_relay import GenerationRelay, error_answer
from rlfleet_router.metrics import RequestMetricsMiddleware
from rlfleet_router.policies import RoutingRequest
from rlfleet_router.proxy import EngineResponse
from rlfleet_router.weight_group_routes import weight_group_routes
from rlfleet_router.worker_routes import worker_routes
from rlfleet_router.workers import NoHealthyEngine

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

logger = logging.getLogger(__name__)


def create_app(config: RouterConfig) -> GenerationRelay:
    fleet = Fleet(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await fleet.start()
        try:
            yield
        finally:
            await fleet.stop()

    app = FastAPI(title="rlfleet router", lifespan=lifespan)
    app.state.fleet = fleet
    install_error_handlers(app)

    @app.exception_handler(NoHealthyEngine)  # before RlfleetError's: the most specific handler is the one used
    async def no_healthy_engine(request: Request, exc: NoHealthyEngine) -> Response:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_answer(exc, config)

    app.add_middleware(RequestMetricsMiddleware, metrics=fleet.metrics)
    # Admin requests (workers, weight loads, aborts, pause/continue, flush) need the token; reads stay open.
    guard = ApiTokenGuard.from_file(config.api_token_file, fleet.metrics.registry, "router")
    # SGLang serves GET /flush_cache too (clients such as slime's use it): a GET that changes state keeps the token.
    require_api_token(app, guard, open_methods=("GET", "HEAD"), guarded_paths=(FLUSH_ROUTE,))

    def control(route: str) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def fan_out(request: Request) -> JSONResponse:
            body = await request.body()
            if body.strip():
                parse_json_object(body)  # one clear 400 here rather than one from every engine
            # The query too: SGLang's /flush_cache takes its timeout there.
            status, summary = await fleet.fanout.send(route, body, request.headers, request.url.query)
            return JSONResponse(summary, status_code=status)

        return fan_out

    for route in FANOUT_ROUTES:
        methods = ["GET", "POST"] if route == FLUSH_ROUTE else ["POST"]
        app.add_api_route(route, control(route), methods=methods, response_model=None)

    @app.get("/v1/models")
    async def models(request: Request) -> EngineResponse:
        return await fleet.proxy.forward(RoutingRequest(route="/v1/models"), b"", request.headers, method="GET")

    # :path, so ids with slashes (`<run>/<group>/<sample>`, as the README suggests) can be read and deleted.
    @app.get("/trajectories/{trajectory_id:path}")
    async def get_trajectory(trajectory_id: str) -> dict[str, object]:
        return fleet.trajectories.get(trajectory_id).describe()

    @app.delete("/trajectories/{trajectory_id:path}")
    async def delete_trajectory(trajectory_id: str) -> dict[str, object]:
        fleet.trajectories.delete(trajectory_id)
        return {"status": "deleted", "trajectory_id": trajectory_id}

    # Each name relayed as the client asked it: SGLang serves /model_info and /server_info, and the get_ names
    # before them (deprecated since, and announced for removal); a client knows which its engines have.
    @app.get("/get_model_info")
    @app.get("/model_info")
    @app.get("/get_server_info")
    @app.get("/server_info")
    async def engine_info(request: Request) -> EngineResponse:
        route = RoutingRequest(route=request.url.path)
        return await fleet.proxy.forward(route, b"", request.headers, method="GET")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(update: UpdateWeightsRequest, request: Request) -> JSONResponse:
        # Every field goes to the engines, so SGLang options the router does not model still apply;
        # re-encoded rather than forwarded as bytes so a numeric weight_version reaches them as text.
        body = json.dumps(update.model_dump()).encode()
        # A caller that gave up while its update queued must not see that version land later.
        result = await fleet.weights.update_fleet(
            update.model_path, update.weight_version, body, request.is_disconnected
        )
        return JSONResponse(result.describe(), status_code=result.http_status)

    app.include_router(weight_group_routes(fleet))

    @app.get("/weight_version")
    async def weight_version() -> dict[str, object]:
        target = fleet.weights.target
        return {
            "weight_version": target.version if target else None,
            "model_path": target.model_path if target else None,
        }

    @app.get("/fleet")
    async def fleet_status() -> dict[str, object]:
        return fleet.describe()

    app.include_router(worker_routes(fleet))

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/readiness", methods=["GET", "HEAD"])
    async def health() -> dict[str, object]:
        healthy = len(fleet.workers.healthy())
        total = len(fleet.workers.all())
        if not healthy:
            raise NoHealthyEngine(total)
        return {"status": "ok", "healthy": healthy, "total": total}

    @app.api_route("/liveness", methods=["GET", "HEAD"])
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(fleet.metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)

    # Around the whole app, so generation requests (POST /generate, /v1/completions, /v1/chat/completions)
    # skip FastAPI's middleware stack and routing; lifespan and every other request go on to the app.
    # Both bound request bodies alike (the relay on its own): every request is buffered whole before it is routed.
    bounded = BodySizeLimitMiddleware(app, max_bytes=config.max_request_bytes)
    return GenerationRelay(bounded, fleet, max_bytes=config.max_request_bytes)
