"""HTTP side of the trainer: /health and Prometheus /metrics."""

from __future__ import annotations

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rlfleet.http_errors import install_error_handlers
from rlfleet_trainer.metrics import TrainerMetrics


def make_http_app(metrics: TrainerMetrics) -> FastAPI:
    app = FastAPI(title="rlfleet trainer", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
