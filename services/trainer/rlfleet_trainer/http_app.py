"""HTTP side of a trainer node: /health and Prometheus /metrics.

Rank 0 serves it beside the gRPC Trainer API. Kubernetes probes every pod of a multi-node trainer,
so the first rank of every other node serves it too (node_http.py), without the API: /health then
says that this rank is alive and follows rank 0, never that it serves the API.

/health is every probe of a trainer pod (startup, liveness, readiness): it answers 503 naming the
cause once the ranks are out of step for good (rank_group.py), which only a restart mends; the
process ends then anyway, so that torchrun and Kubernetes restart the job.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rlfleet.errors import Unavailable
from rlfleet.http_errors import install_error_handlers


def make_http_app(
    registry: CollectorRegistry,
    rank: int = 0,
    world_size: int = 1,
    broken: Callable[[], str | None] = lambda: None,
) -> FastAPI:
    """registry: what /metrics exports (on a follower, its rank ops only: it trains no run of its own).
    broken: why the ranks are out of step for good (`RankGroup.broken`), or None while they work."""
    app = FastAPI(title="rlfleet trainer", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    health_body = {"status": "ok", "rank": rank, "world_size": world_size, "serves_api": rank == 0}

    @app.get("/health")
    def health() -> dict[str, object]:
        why = broken()
        if why is not None:
            raise Unavailable(why)
        return health_body

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
