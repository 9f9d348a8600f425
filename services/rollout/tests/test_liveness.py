"""The orchestrator's probes: /liveness answers whatever Redis does (the orchestrator waits out a
Redis outage, so a restart would not help), /health is readiness and needs Redis. Both are open to
probes that carry no API token."""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis
from fastapi.testclient import TestClient

from rlfleet.api_token import ApiTokenGuard
from rlfleet.processes import free_port
from rlfleet_rollout.http_app import build_app
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.runs_core import RunsCore


def test_liveness_answers_while_redis_is_down_and_health_does_not() -> None:
    metrics = RolloutMetrics()
    guard = ApiTokenGuard("a-token", metrics.registry, "rollout")
    # Nothing listens there, and this client does not retry: Redis is down for as long as the test runs.
    down = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1, retry_on_error=[])
    # The probes never touch the core.
    app = build_app(cast(RunsCore, object()), metrics, down, guard, watch_keepalive_s=15.0)
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "redis unreachable" in health.json()["error"]["message"]
        liveness = client.get("/liveness")
        assert liveness.status_code == 200 and liveness.json() == {"status": "ok"}
        assert client.get("/v1/runs").status_code == 401, "the Runs API itself stays guarded"
