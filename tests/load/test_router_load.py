"""The router in front of two sim engines under sustained concurrent load on loopback: every request
answered, p99 latency and memory within bounds (figures printed; the full form is `make test-load`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator

import httpx
import pytest
from launchers import Service, start_router, start_sim_engines
from load_driver import LOAD_SECONDS, sustain

pytestmark = [pytest.mark.e2e, pytest.mark.load]

CONCURRENCY = 8
P99_BOUND_S = 1.0
MIN_REQUESTS_PER_S = 20
RSS_GROWTH_BOUND_MIB = 16.0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("logs")
    engines = start_sim_engines(2, logs, ["--sim-decode-ms-per-step", "1"])
    router = start_router([e.url for e in engines], logs)
    yield router
    router.stop()
    for engine in engines:
        engine.stop()


def generate(client: httpx.AsyncClient, n: int) -> Awaitable[httpx.Response]:
    # GRPO-like traffic: 64 prompt families with a shared 48-token prefix, 4 new tokens each.
    prompt = [100 + n % 64] * 48 + [7 + n % 5]
    return client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})


def test_router_holds_sustained_load(router: Service) -> None:
    asyncio.run(sustain(router.url, generate, concurrency=CONCURRENCY, seconds=1.0, pid=router.process.pid))  # warm
    result = asyncio.run(
        sustain(router.url, generate, concurrency=CONCURRENCY, seconds=LOAD_SECONDS, pid=router.process.pid)
    )
    print(result.summary("router /generate", CONCURRENCY))
    assert result.statuses.keys() == {200} and result.transport_errors == 0, result.summary("router", CONCURRENCY)
    assert result.requests >= MIN_REQUESTS_PER_S * LOAD_SECONDS
    assert result.quantile(0.99) <= P99_BOUND_S
    assert result.rss_growth_mib <= RSS_GROWTH_BOUND_MIB
    assert router.process.alive()
