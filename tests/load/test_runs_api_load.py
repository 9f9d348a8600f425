"""The Runs API (GET one run, list a page) under sustained concurrent load on loopback, with the API
token on: every request answered, p99 latency and memory within bounds (full form: `make test-load`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Iterator

import httpx
import pytest
import redis
from launchers import Service, StandInRewardHub, delete_prefix, start_orchestrator, write_char_tokenizer, write_token
from load_driver import LOAD_SECONDS, sustain

pytestmark = [pytest.mark.e2e, pytest.mark.load]

CONCURRENCY = 8
RUNS = 30
P99_BOUND_S = 1.0
MIN_REQUESTS_PER_S = 20
RSS_GROWTH_BOUND_MIB = 16.0


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, redis_client: redis.Redis
) -> Iterator[tuple[Service, str, list[str]]]:
    """An orchestrator holding RUNS runs, its token, and the run ids."""
    token, token_file = write_token(tmp_path_factory.mktemp("secrets"))
    tokenizer = write_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:12]}:"
    hub = StandInRewardHub()
    service = start_orchestrator(
        tmp_path_factory.mktemp("logs"),
        prefix=prefix,
        reward_url=hub.url,
        router_url="http://127.0.0.1:9",
        token_file=token_file,
    )
    spec = {
        "model": {"path": str(tokenizer)},
        "dataset": {"arithmetic": {"digits": 1, "ops": "+"}, "eval_size": 4},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "schedule": {"steps": 1},
    }
    headers = {"Authorization": f"Bearer {token}"}
    ids = [
        httpx.post(f"{service.url}/v1/runs", json=spec, headers=headers, timeout=30).json()["id"] for _ in range(RUNS)
    ]
    yield service, token, ids
    service.stop()
    hub.stop()
    delete_prefix(redis_client, prefix)


def test_runs_api_holds_sustained_load(api: tuple[Service, str, list[str]]) -> None:
    service, token, ids = api
    headers = {"Authorization": f"Bearer {token}"}

    def get_or_list(client: httpx.AsyncClient, n: int) -> Awaitable[httpx.Response]:
        if n % 4 == 0:
            return client.get("/v1/runs", params={"page_size": 20}, headers=headers)
        return client.get(f"/v1/runs/{ids[n % len(ids)]}", headers=headers)

    asyncio.run(sustain(service.url, get_or_list, concurrency=CONCURRENCY, seconds=1.0, pid=service.process.pid))
    result = asyncio.run(
        sustain(service.url, get_or_list, concurrency=CONCURRENCY, seconds=LOAD_SECONDS, pid=service.process.pid)
    )
    print(result.summary("runs api GET/list", CONCURRENCY))
    assert result.statuses.keys() == {200} and result.transport_errors == 0, result.summary("runs api", CONCURRENCY)
    assert result.requests >= MIN_REQUESTS_PER_S * LOAD_SECONDS
    assert result.quantile(0.99) <= P99_BOUND_S
    assert result.rss_growth_mib <= RSS_GROWTH_BOUND_MIB
    assert service.process.alive()
