"""schemathesis against the Runs API's and the router's OpenAPI schemas: no request gets a 5xx, and
neither service dies. Bounded (a fixed number of derandomized examples per operation) to stay under a
minute on two cores."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis
from launchers import Service
from schema_fuzz import fuzz_operations

pytestmark = pytest.mark.e2e

EXAMPLES_PER_OPERATION = 25
# Router operations whose generated requests would make engines fail by design, reported as 502: a worker
# at a generated URL leaves the fleet with an engine that cannot answer (every fan-out after it reports
# it), and a weight-update group at a generated master address makes each engine try to join it.
NOT_FUZZED = {
    "POST /workers",
    "POST /init_weights_update_group",
    "POST /update_weights_from_distributed",
    "POST /destroy_weights_update_group",
}


def test_runs_api_answers_every_generated_request_below_500(
    orchestrator: Service, api_token: tuple[str, Path], redis_client: redis.Redis, runs_prefix: str
) -> None:
    headers = {"Authorization": f"Bearer {api_token[0]}"}
    sent = fuzz_operations(orchestrator.url, headers, examples=EXAMPLES_PER_OPERATION)
    print(f"runs api: {sum(sent.values())} generated requests over {len(sent)} operations: {sent}")
    assert {"POST /v1/runs", "GET /v1/runs", "GET /v1/runs/{run_id}"} <= set(sent)
    assert sum(sent.values()) >= 4 * EXAMPLES_PER_OPERATION
    assert orchestrator.process.alive()
    assert httpx.get(f"{orchestrator.url}/health", timeout=10).status_code == 200


def test_router_answers_every_generated_request_below_500(secured_router: Service, api_token: tuple[str, Path]) -> None:
    headers = {"Authorization": f"Bearer {api_token[0]}"}
    sent = fuzz_operations(secured_router.url, headers, examples=EXAMPLES_PER_OPERATION, skip=NOT_FUZZED)
    print(f"router: {sum(sent.values())} generated requests over {len(sent)} operations: {sent}")
    assert {"POST /update_weights_from_disk", "POST /abort_request", "DELETE /workers/{worker_key}"} <= set(sent)
    assert secured_router.process.alive()
    assert httpx.get(f"{secured_router.url}/health", timeout=10).status_code == 200
