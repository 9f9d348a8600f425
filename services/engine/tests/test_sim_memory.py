"""The `sim` backend's KV memory and decode cost: running requests hold KV, others wait, long contexts decode slower.

Every figure here comes from the simulation, not from a model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from rlfleet.errors import InvalidInput
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.http_app import create_app
from rlfleet_engine.schemas import GenerateRequest
from rlfleet_engine.sim_backend import LatencyModel, SimEngineCore
from rlfleet_engine.sim_prefix_cache import PrefixCache


def blocks(first: int, count: int, size: int = 4) -> list[int]:
    """`count` whole blocks of distinct token ids starting at `first`."""
    return list(range(first, first + count * size))


def test_a_lease_waits_until_the_running_request_frees_its_blocks() -> None:
    cache = PrefixCache(max_tokens=16, block_size=4)  # four blocks
    first, second = blocks(0, 3), blocks(100, 3)
    running = cache.lease(first, extra_tokens=0)
    assert running is not None and cache.in_use_tokens == 12
    assert cache.lease(second, extra_tokens=0) is None, "three blocks do not fit next to three pinned ones"
    cache.release(running, first)
    assert cache.in_use_tokens == 0 and cache.tokens == 12, "a finished request's blocks stay cached, unpinned"
    assert cache.lease(second, extra_tokens=0) is not None, "evicting the finished request's blocks makes room"
    assert cache.match(first) == 4 and cache.tokens == 16, "only the first request's prefix block is left"


def test_pinned_blocks_are_never_evicted_and_private_tokens_count() -> None:
    cache = PrefixCache(max_tokens=32, block_size=4)
    prompt = blocks(0, 2) + [7, 7]  # two whole blocks and a partial one
    lease = cache.lease(prompt, extra_tokens=6)
    assert lease is not None and lease.private_tokens == 2 + 6 and cache.in_use_tokens == 8 + 8
    for start in range(100, 300, 4):  # far more than the budget, from finished requests
        cache.insert(blocks(start, 1))
    assert cache.match(prompt) == 8, "the running request's blocks survived"
    assert cache.tokens + cache.private_tokens <= 32
    assert cache.lease(blocks(500, 4), extra_tokens=1) is None, "17 tokens exceed the 16 not held by the lease"
    cache.release(lease, prompt + [1, 2])
    for start in range(300, 500, 4):
        cache.insert(blocks(start, 1))
    assert cache.match(prompt) == 0, "unpinned, they age out like any block"


def test_blocks_shared_by_running_requests_count_once() -> None:
    cache = PrefixCache(max_tokens=20, block_size=4)
    prompt = blocks(0, 4)
    leases = [cache.lease(prompt, extra_tokens=2) for _ in range(2)]
    assert all(lease is not None for lease in leases)
    # The second sample finds the whole prompt cached; the engine still computes its last token for the logits,
    # and the hit rate counts what meta_info.cached_tokens reports.
    assert leases[1] is not None and leases[1].cached_tokens == 15
    assert cache.hit_rate == 15 / 32
    assert cache.in_use_tokens == 16 + 2 + 2
    assert cache.lease(prompt, extra_tokens=1) is None, "no room left for a third sample's private tokens"
    first = leases[0]
    assert first is not None
    cache.release(first, prompt)
    assert cache.match(prompt) == 16, "still pinned by the other sample"


def test_step_time_grows_with_the_context_the_batch_holds() -> None:
    latency = LatencyModel(
        prefill_secs_per_token=0.0,
        decode_secs_per_step=0.01,
        decode_secs_per_sequence=0.0,
        decode_secs_per_kv_token=1e-6,
    )
    assert latency.iteration_secs(batch=2, prefill_tokens=0, context_tokens=10_000) == pytest.approx(0.02)
    assert latency.iteration_secs(batch=2, prefill_tokens=0, context_tokens=0) == pytest.approx(0.01)


def sim_core(**settings: Any) -> SimEngineCore:
    config = EngineConfig(model_path="sim", sim_prefill_us_per_token=0.0, sim_decode_us_per_sequence=0.0, **settings)
    return SimEngineCore(config, CollectorRegistry())


def request(text: str, max_new_tokens: int) -> GenerateRequest:
    return GenerateRequest.model_validate({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}})


async def run_two(core: SimEngineCore, first: str, second: str) -> tuple[tuple[int, int], list[float]]:
    """Sends two requests at once; the engine's (running, waiting) shortly after, and their latencies."""
    tasks = [asyncio.create_task(core.generate(request(text, 10))) for text in (first, second)]
    await asyncio.sleep(0.05)
    counts = core.scheduler.counts()
    outputs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    await core.scheduler.stop()
    return counts, [out["meta_info"]["e2e_latency"] for out in outputs]  # type: ignore[call-overload]


def test_a_request_that_does_not_fit_waits_for_the_running_one() -> None:
    first, second = "a" * 40, "b" * 40  # 40 prompt + 10 new tokens each: one fits in 64 tokens, two do not
    tight = sim_core(sim_cache_tokens=64, sim_decode_ms_per_step=20.0)
    counts, (first_secs, second_secs) = asyncio.run(run_two(tight, first, second))
    assert counts == (1, 1)
    assert second_secs > 1.6 * first_secs, "the second request ran only after the first (10 steps each)"

    roomy = sim_core(sim_cache_tokens=128, sim_decode_ms_per_step=20.0)
    counts, _ = asyncio.run(run_two(roomy, first, second))
    assert counts == (2, 0)


def test_decoding_a_long_context_is_slower() -> None:
    async def latency(text: str) -> float:
        core = sim_core(sim_decode_ms_per_step=1.0, sim_decode_us_per_kv_token=50.0)
        out = await core.generate(request(text, 10))
        await core.scheduler.stop()
        return out["meta_info"]["e2e_latency"]  # type: ignore[call-overload,no-any-return]

    short, long = asyncio.run(latency("x" * 20)), asyncio.run(latency("x" * 400))
    # 10 steps of 1 ms + 50 us x (20..30 tokens) against 1 ms + 50 us x (400..410 tokens).
    assert short < 0.1 and long > 0.15


def test_a_request_larger_than_the_whole_budget_is_refused() -> None:
    registry = CollectorRegistry()
    core = SimEngineCore(EngineConfig(model_path="sim", sim_cache_tokens=64, sim_decode_ms_per_step=0.1), registry)
    with TestClient(create_app(core, registry)) as client:  # type: ignore[arg-type]
        answer = client.post("/generate", json={"text": "x" * 60, "sampling_params": {"max_new_tokens": 8}})
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "length of 64 tokens" in message and "60 tokens from the input messages and 8 tokens" in message
        reaches = client.post("/generate", json={"text": "x" * 56, "sampling_params": {"max_new_tokens": 8}})
        assert reaches.status_code == 400, "SGLang refuses a prompt and max_new_tokens reaching its bound"
        fits = client.post("/generate", json={"text": "x" * 55, "sampling_params": {"max_new_tokens": 8}})
        assert fits.status_code == 200, fits.text
        # A default or null budget is what the KV budget leaves, as in SGLang (less 2, as its scheduler cuts it);
        # it was refused as over the budget.
        for sampling in ({}, {"max_new_tokens": None}):
            clamped = client.post("/generate", json={"text": "x" * 60, "sampling_params": sampling})
            assert clamped.status_code == 200, clamped.text
            assert clamped.json()["meta_info"]["completion_tokens"] == 2
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64


def test_finished_requests_leave_nothing_in_flight() -> None:
    async def scenario() -> dict[str, Any]:
        core = sim_core(sim_decode_ms_per_step=0.1)
        await core.generate(GenerateRequest.model_validate({"text": "ab", "sampling_params": {"n": 8}}))
        stream = GenerateRequest.model_validate(
            {"text": "ab", "stream": True, "sampling_params": {"max_new_tokens": 2}}
        )
        assert len([chunk async for chunk in core.generate_stream(stream)]) == 2
        left = dict(core.in_flight)
        await core.scheduler.stop()
        return left

    assert asyncio.run(scenario()) == {}, "a finished request's jobs (prompt, outputs) are let go when it is answered"


def test_a_small_body_asking_for_many_copies_of_a_long_prompt_is_refused() -> None:
    registry = CollectorRegistry()
    core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), registry)
    with TestClient(create_app(core, registry)) as client:  # type: ignore[arg-type]
        # 31 KiB of JSON asking for 1024 x 32000 prompt tokens.
        body = {"text": "a" * 32000, "sampling_params": {"n": 1024, "max_new_tokens": 1}}
        answer = client.post("/generate", json=body)
        assert answer.status_code == 413, answer.text[:200]
        message = answer.json()["error"]["message"]
        assert "32768000 prompt tokens" in message and "at most 4194304" in message
        assert core.in_flight == {}


def test_the_vocabulary_is_as_large_as_the_clients_tokenizer_s() -> None:
    """Prompts tokenized by a real tokenizer (Qwen's ids reach 151643) were refused past 65535."""
    core = SimEngineCore(
        EngineConfig(model_path="sim", sim_vocab_size=152064, sim_decode_ms_per_step=0.1), CollectorRegistry()
    )
    body = {"input_ids": [151643, 9707, 151644], "sampling_params": {"max_new_tokens": 2}}

    async def generate() -> dict[str, Any]:
        out = await core.generate(GenerateRequest.model_validate(body))
        await core.scheduler.stop()
        assert isinstance(out, dict)
        return out

    assert asyncio.run(generate())["meta_info"]["prompt_tokens"] == 3
    narrow = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), CollectorRegistry())
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        asyncio.run(narrow.generate(GenerateRequest.model_validate(body)))
