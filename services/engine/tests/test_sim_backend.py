"""The `sim` backend as a real process: SGLang's contract, a real prefix cache, seeded tokens, a latency model.

Every figure here comes from the simulation, not from a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rlfleet_engine.sim_prefix_cache import PrefixCache

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. Think step by step, then answer with a number only. "


def generate(url: str, body: dict[str, object]) -> dict[str, Any]:
    answer = httpx.post(url + "/generate", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_prefix_cache_serves_repeats_and_is_emptied_by_a_weight_load_and_a_flush(
    start_sim: Callable[..., str],
) -> None:
    url = start_sim("--sim-prefill-us-per-token", "5000", "--sim-decode-ms-per-step", "1")
    params = {"max_new_tokens": 4}
    cold = generate(url, {"text": SYSTEM + "12+7=", "sampling_params": params})
    warm = generate(url, {"text": SYSTEM + "12+8=", "sampling_params": params})
    assert cold["meta_info"]["cached_tokens"] == 0
    prompt = len(SYSTEM) + 5
    assert warm["meta_info"]["prompt_tokens"] == prompt
    assert warm["meta_info"]["cached_tokens"] == len(SYSTEM) // 16 * 16, "whole blocks of the shared prefix"
    # 86 uncached prompt tokens at 5 ms each against 6: the latency model charges only uncached prefill.
    cold_secs, warm_secs = cold["meta_info"]["e2e_latency"], warm["meta_info"]["e2e_latency"]
    assert cold_secs > 0.42 and warm_secs < cold_secs - 0.3

    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'sglang:cached_tokens_total{model_name="sim"} 80.0' in metrics
    rate = next(line for line in metrics.splitlines() if line.startswith("sglang:cache_hit_rate{"))
    assert float(rate.rpartition(" ")[2]) == pytest.approx(80 / (2 * prompt))
    info = httpx.get(url + "/get_server_info", timeout=10).json()
    assert info["backend"] == "sim" and info["max_total_num_tokens"] == info["sim_cache_tokens"]
    state = info["internal_states"][0]
    assert state["cache_hit_rate"] == pytest.approx(80 / (2 * prompt)) and state["cached_tokens"] > 0

    unread = {"model_path": "/ckpt/1", "weight_version": "1", "load_format": "pt"}
    refused = httpx.post(url + "/update_weights_from_disk", json=unread, timeout=10)
    assert refused.status_code == 400 and "load_format 'pt'" in refused.text, "the model backend reads no .pt"
    assert generate(url, {"text": SYSTEM + "12+7=", "sampling_params": params})["meta_info"]["weight_version"] != "1"
    load = httpx.post(url + "/update_weights_from_disk", json={"model_path": "/ckpt/1", "weight_version": "1"})
    assert load.status_code == 200 and load.json()["success"] is True
    after = generate(url, {"text": SYSTEM + "12+8=", "sampling_params": params})
    assert after["meta_info"]["cached_tokens"] == 0 and after["meta_info"]["weight_version"] == "1"

    again = generate(url, {"text": SYSTEM + "12+9=", "sampling_params": params})
    assert again["meta_info"]["cached_tokens"] > 0
    kept = {"model_path": "/ckpt/2", "weight_version": "2", "flush_cache": False}
    assert httpx.post(url + "/update_weights_from_disk", json=kept).json()["success"] is True
    again = generate(url, {"text": SYSTEM + "12+9=", "sampling_params": params})
    assert again["meta_info"]["cached_tokens"] > 0, "a load told not to flush keeps the cache"
    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 200
    flushed = generate(url, {"text": SYSTEM + "12+9=", "sampling_params": params})
    assert flushed["meta_info"]["cached_tokens"] == 0


def test_tokens_depend_only_on_seed_prompt_and_sample(start_sim: Callable[..., str]) -> None:
    first, second, other_seed = start_sim(), start_sim(), start_sim("--random-seed", "7")
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "n": 2}, "return_logprob": True}
    a, b, c = generate(first, body), generate(second, body), generate(other_seed, body)
    assert isinstance(a, list) and len(a) == 2
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert a[0]["output_ids"] != a[1]["output_ids"], "samples of one prompt differ"
    assert [x["output_ids"] for x in a] != [x["output_ids"] for x in c]
    assert len(a[0]["meta_info"]["output_token_logprobs"]) == 6
    info = httpx.get(first + "/get_model_info", timeout=10).json()
    assert info["model_type"] == "sim"
    # A group sent as one-sample requests with their own seeds (as the orchestrator sends it): every sample of
    # it was the same, so its rewards had no variance on this backend.
    seeded = [
        generate(first, {**body, "sampling_params": {"max_new_tokens": 6, "sampling_seed": seed}})["output_ids"]
        for seed in (1, 2, 1)
    ]
    assert seeded[0] != seeded[1] and seeded[0] == seeded[2]


def test_prefix_cache_matches_whole_blocks_and_evicts_the_least_recent() -> None:
    cache = PrefixCache(max_tokens=64, block_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 10]) == 8 and cache.tokens == 8
    for start in range(100, 164, 4):
        cache.insert(list(range(start, start + 4)))
    assert cache.tokens == 64 and cache.match([1, 2, 3, 4]) == 0, "LRU blocks went first"
