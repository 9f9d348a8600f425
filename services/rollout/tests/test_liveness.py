"""The orchestrator's probes: /liveness answers whatever Redis does (the orchestrator waits out a
Redis outage, so a restart would not help), /health is readiness and needs Redis, and says so within a
probe's timeout. Both are open to probes that carry no API token. With Redis down the Runs API answers
503 naming it, not 500."""

from __future__ import annotations

import time
from typing import cast

import httpx
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from rlfleet.api_token import ApiTokenGuard
from rlfleet.processes import free_port
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.http_app import HEALTH_TIMEOUT_S, build_app, health_client
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
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


def test_with_redis_down_health_answers_within_a_probe_timeout_and_the_api_503_naming_redis() -> None:
    """The review's case: /health took 29 s to say 503 (the client's retries; a probe gives up after 5 s), and the
    Runs API answered 500 "internal error"."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    metrics = RolloutMetrics()
    guard = ApiTokenGuard(None, metrics.registry, "rollout")
    records = aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0))  # the API's client, its retries run out
    core = RunsCore(
        RunStore(records, "x:"),
        RewardClient(httpx.AsyncClient(), "http://127.0.0.1:9", score_timeout_s=1, validate_timeout_s=1),
        RunNotifier(),
        metrics,
        filters=FilterRegistry({}),
        rollouts=RolloutRegistry.from_entry_points(),
        poll_interval_s=0.1,
        run_data_retention_s=60,
    )
    app = build_app(core, metrics, health_client(url), guard, watch_keepalive_s=15.0)
    with TestClient(app) as client:
        asked = time.monotonic()
        health = client.get("/health")
        assert time.monotonic() - asked < HEALTH_TIMEOUT_S + 1
        assert health.status_code == 503 and "redis unreachable" in health.json()["error"]["message"]
        for method, path in [("GET", "/v1/runs/run-a"), ("GET", "/v1/runs"), ("POST", "/v1/runs/run-a:cancel")]:
            answer = client.request(method, path)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"]["message"].startswith("run records (Redis) unreachable: "), answer.text
