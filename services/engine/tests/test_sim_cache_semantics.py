"""What the `sim` backend reports as cached, and what it charges, around weight loads and within one iteration.

A block counts as cached only once an earlier iteration computed it (or, for the n samples of one prompt, the
same iteration's prefill of that prompt), never if it was computed under weights a load has replaced; a request
held through a flushing load recomputes its KV after the load; `sglang:num_used_tokens` is the KV in use.
In process; every figure here comes from the simulation, not from a model.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.schemas import GenerateRequest, UpdateWeightsFromDiskRequest
from rlfleet_engine.sim_backend import SimEngineCore
from rlfleet_engine.sim_prefix_cache import PrefixCache

PROMPT = list(range(1, 2001))  # 2000 tokens: 125 whole blocks


def blocks(first: int, count: int, size: int = 4) -> list[int]:
    """`count` whole blocks of distinct token ids starting at `first`."""
    return list(range(first, first + count * size))


def sim_core(**settings: Any) -> tuple[SimEngineCore, CollectorRegistry]:
    registry = CollectorRegistry()
    config = EngineConfig(model_path="sim", sim_decode_us_per_sequence=0.0, **settings)
    return SimEngineCore(config, registry), registry


def request(ids: list[int], max_new_tokens: int, n: int = 1, rid: str | None = None) -> GenerateRequest:
    return GenerateRequest.model_validate(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "n": n}, "rid": rid}
    )


def metric(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "sim"})
    if value is None:  # a scheduler gauge: SGLang's scheduler labels
        value = registry.get_sample_value(
            name, {"model_name": "sim", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        )
    assert value is not None, name
    return value


def single(out: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    assert isinstance(out, dict)
    return out


def test_identical_prompts_admitted_together_both_pay_their_prefill() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any], float, float]:
        core, registry = sim_core(sim_decode_ms_per_step=1.0, sim_prefill_us_per_token=100.0)
        # Both are submitted before the scheduler's first iteration: one prefill batch.
        together = await asyncio.gather(*(core.generate(request(PROMPT, 1)) for _ in range(2)))
        hit_rate = metric(registry, "sglang:cache_hit_rate")
        later = single(await core.generate(request(PROMPT, 1)))
        cached_total = metric(registry, "sglang:cached_tokens_total")
        await core.scheduler.stop()
        return [single(out) for out in together], later, hit_rate, cached_total

    together, later, hit_rate, cached_total = asyncio.run(scenario())
    assert [out["meta_info"]["cached_tokens"] for out in together] == [0, 0], "nothing had computed those blocks yet"
    # Both prompts' prefill is charged: 2 x 2000 tokens x 100 us.
    assert min(out["meta_info"]["e2e_latency"] for out in together) > 0.4
    assert hit_rate == 0.0, "the hit rate of that prefill batch"
    assert later["meta_info"]["cached_tokens"] == 1999, "an earlier iteration computed them: cached from then on"
    assert cached_total == 1999


def test_a_burst_over_the_prefill_budget_is_split_and_the_later_part_finds_the_prefix_cached() -> None:
    async def scenario() -> list[dict[str, Any]]:
        core, _ = sim_core(sim_decode_ms_per_step=1.0, max_prefill_tokens=3000)
        outs = await asyncio.gather(*(core.generate(request(PROMPT, 1)) for _ in range(3)))
        await core.scheduler.stop()
        return [single(out) for out in outs]

    # 2000 uncached tokens fill most of the 3000-token batch: the two behind wait one iteration, then hit.
    assert [out["meta_info"]["cached_tokens"] for out in asyncio.run(scenario())] == [0, 1999, 1999]


def test_a_request_over_the_prefill_budget_still_runs_alone() -> None:
    async def scenario() -> dict[str, Any]:
        core, _ = sim_core(sim_decode_ms_per_step=1.0, max_prefill_tokens=100)
        out = single(await asyncio.wait_for(core.generate(request(PROMPT, 2)), timeout=30))
        await core.scheduler.stop()
        return out

    assert asyncio.run(scenario())["meta_info"]["completion_tokens"] == 2


def test_the_samples_of_one_prompt_share_its_prefill() -> None:
    async def scenario() -> list[dict[str, Any]]:
        core, _ = sim_core(sim_decode_ms_per_step=1.0)
        out = await core.generate(request(list(range(1, 65)), 1, n=4))
        await core.scheduler.stop()
        assert isinstance(out, list)
        return out

    # As SGLang does with parallel sampling: the prompt is prefilled once, its n copies hit the cache.
    assert [out["meta_info"]["cached_tokens"] for out in asyncio.run(scenario())] == [0, 63, 63, 63]


def test_a_cache_used_without_iterations_counts_every_block_it_holds() -> None:
    # bench/router_vs_sglang_router.py's hit ceiling replays traffic through a bare PrefixCache, one request
    # after another: what an earlier request computed, prompt or output, is cached for the next.
    cache = PrefixCache(max_tokens=1 << 20, block_size=4)
    first = cache.lease(blocks(0, 3), extra_tokens=8)
    assert first is not None and first.cached_tokens == 0
    cache.release(first, blocks(0, 5))  # the prompt and two blocks of output
    again = cache.lease(blocks(0, 6), extra_tokens=8)
    assert again is not None and again.cached_tokens == 20
    sibling = cache.lease(blocks(0, 6), extra_tokens=8)
    assert sibling is not None and sibling.cached_tokens == 23, "the block `again` computed is cached too"


def test_a_flushing_load_leaves_no_old_kv_cached_and_a_held_request_recomputes_its_own() -> None:
    other = list(range(3000, 3064))

    async def scenario() -> dict[str, Any]:
        core, registry = sim_core(sim_decode_ms_per_step=20.0, sim_prefill_us_per_token=100.0)
        held = asyncio.create_task(core.generate(request(PROMPT, 30, rid="held")))
        dropped = asyncio.create_task(core.generate(request(other, 30, rid="dropped")))
        await asyncio.sleep(0.35)  # both prefilled, a few tokens each
        await core.pause("retract")
        done = len(core.in_flight["held"].output_ids)
        load = UpdateWeightsFromDiskRequest(model_path="/ckpt/v1", weight_version="1")
        assert (await core.update_weights_from_disk(load))["num_paused_requests"] == 2
        cached_after_load = core.server_info()["internal_states"][0]["cached_tokens"]
        core.abort("dropped")
        # Sent during the pause: admitted in the held request's first iteration after continue.
        same_prompt = asyncio.create_task(core.generate(request(PROMPT, 1)))
        await asyncio.sleep(0)
        resumed = time.monotonic()
        core.resume()
        out = single(await held)
        held_secs = time.monotonic() - resumed
        new = single(await same_prompt)
        await dropped
        after = single(await core.generate(request(PROMPT, 1)))
        after_other = single(await core.generate(request(other, 1)))
        await core.scheduler.stop()
        return {
            "done": done,
            "cached_after_load": cached_after_load,
            "held": out,
            "held_secs": held_secs,
            "new": new,
            "after": after,
            "after_other": after_other,
            "used": metric(registry, "sglang:num_used_tokens"),
        }

    result = asyncio.run(scenario())
    assert result["cached_after_load"] == 0, "the old weights' KV is no cache of the new ones"
    assert [span["version"] for span in result["held"]["meta_info"]["weight_versions"]] == ["default", "1"]
    assert result["new"]["meta_info"]["cached_tokens"] == 0, "blocks still holding the old weights' KV"
    # Re-prefill of the held request's prompt + output (>= 0.2 s at 100 us a token) plus its remaining steps.
    remaining = 30 - result["done"]
    assert result["held_secs"] > 0.9 * ((len(PROMPT) + result["done"]) * 100e-6 + remaining * 0.02)
    assert result["after"]["meta_info"]["cached_tokens"] == 1999, "recomputed under the new weights: cached"
    assert result["after_other"]["meta_info"]["cached_tokens"] == 0, "a request aborted while held left no KV"
    assert result["used"] == 0


def test_used_tokens_count_the_kv_in_use_not_the_reservation() -> None:
    async def scenario() -> tuple[float, int, float]:
        core, registry = sim_core(sim_decode_ms_per_step=10.0)
        task = asyncio.create_task(core.generate(request([1] * 10, 5000)))
        await asyncio.sleep(0.15)
        await core.pause("retract")  # a stable count to compare with
        job = next(iter(core.in_flight.values()))
        used, generated = metric(registry, "sglang:num_used_tokens"), len(job.output_ids)
        core.resume()
        core.abort("", abort_all=True)
        await task
        after = metric(registry, "sglang:num_used_tokens")
        await core.scheduler.stop()
        return used, generated, after

    used, generated, after = asyncio.run(scenario())
    assert generated > 3
    assert used == pytest.approx(10 + generated), "prompt + tokens generated so far, not + max_new_tokens 5000"
    assert after == 0


def test_inter_token_latency_is_observed_per_token_and_shows_a_stall() -> None:
    """It was one observation per request, its mean gap: a 0.3 s pause between two tokens vanished into the mean."""

    async def scenario() -> CollectorRegistry:
        core, registry = sim_core(sim_decode_ms_per_step=1.0)
        body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 20}}
        chunks = 0
        async for _ in core.generate_stream(GenerateRequest.model_validate(body)):
            chunks += 1
            if chunks == 5:
                await core.pause("in_place")
                await asyncio.sleep(0.3)
                core.resume()
        await core.scheduler.stop()
        return registry

    registry = asyncio.run(scenario())
    labels = {"model_name": "sim"}
    count = registry.get_sample_value("sglang:inter_token_latency_seconds_count", labels)
    under = registry.get_sample_value("sglang:inter_token_latency_seconds_bucket", {**labels, "le": "0.2"})
    assert count == 19, "one gap per token after the first"
    assert under == 18, "the stall is one gap of its own, past 0.2 s"


def test_a_flush_with_requests_pending_is_refused_and_keeps_the_cache() -> None:
    """As SGLang's: their blocks are in use, so nothing is flushed and the answer is a 400. Answered 200 with the
    cache kept, it told the router to forget what the engine held."""
    from fastapi.testclient import TestClient

    from rlfleet_engine.http_app import create_app

    core, registry = sim_core(sim_decode_ms_per_step=20.0)
    with TestClient(create_app(core, registry)) as client:  # type: ignore[arg-type]
        body = {"input_ids": PROMPT[:64], "sampling_params": {"max_new_tokens": 2}}
        assert client.post("/generate", json=body).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                client.post, "/generate", json={"input_ids": blocks(5000, 8), "sampling_params": {"max_new_tokens": 50}}
            )
            deadline = time.monotonic() + 10
            while core.scheduler.counts() == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = client.post("/flush_cache")
            assert refused.status_code == 400 and "pending requests (1 running, 0 waiting)" in refused.text
            assert running.result(timeout=30).status_code == 200
        again = client.post("/generate", json=body).json()
        assert again["meta_info"]["cached_tokens"] >= 48, "the cache was kept"
        assert client.post("/flush_cache").status_code == 200
        assert client.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


def test_a_request_for_no_tokens_is_prefilled_and_cached() -> None:
    """SGLang prefills such a request (it warms a prompt's cache before its n samples); the sim answered it at once,
    computing nothing, caching nothing and counting none of its prompt."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], float]:
        core, registry = sim_core(sim_decode_ms_per_step=1.0)
        warm = single(await core.generate(request(PROMPT[:640], 0)))
        again = single(await core.generate(request(PROMPT[:640], 2)))
        await core.scheduler.stop()
        return warm, again, metric(registry, "sglang:prompt_tokens_total")

    warm, again, prompt_tokens = asyncio.run(scenario())
    assert warm["output_ids"] == [] and warm["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert again["meta_info"]["cached_tokens"] == 639, "all but the last token, as SGLang computes that one"
    assert prompt_tokens == 2 * 640


def test_held_requests_are_prefilled_again_within_the_prefill_budget() -> None:
    """After a flushing load, the held requests' KV was all computed again in one iteration, whatever its size:
    eight 20k-token requests made one iteration of 16 s at 100 us a token, and a weight load behind it timed out.
    As SGLang re-admits retracted requests, they go through the bounded prefill, over several iterations."""

    async def scenario() -> list[int]:
        core, _ = sim_core(sim_decode_ms_per_step=1.0, sim_prefill_us_per_token=1.0, max_prefill_tokens=4096)
        held = [
            asyncio.create_task(core.generate(request(list(range(10_000 * k, 10_000 * k + 3000)), 20, rid=f"h{k}")))
            for k in range(4)
        ]
        deadline = time.monotonic() + 10
        while len(core.scheduler._running) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await core.pause("retract")
        load = UpdateWeightsFromDiskRequest(model_path="/ckpt/v1", weight_version="1")
        assert (await core.update_weights_from_disk(load))["num_paused_requests"] == 4
        recomputed: list[int] = []
        original = core.scheduler._recompute_stale

        def recompute() -> int:
            recomputed.append(original())
            return recomputed[-1]

        core.scheduler._recompute_stale = recompute  # type: ignore[method-assign]
        core.resume()
        outs = await asyncio.wait_for(asyncio.gather(*held), timeout=30)
        await core.scheduler.stop()
        assert all(len(single(out)["output_ids"]) == 20 for out in outs)
        return [tokens for tokens in recomputed if tokens]

    per_iteration = asyncio.run(scenario())
    assert len(per_iteration) == 4, per_iteration  # one request (3000 + its tokens) a time within 4096
    assert all(tokens <= 4096 for tokens in per_iteration)
