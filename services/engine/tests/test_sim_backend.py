"""The `sim` backend as a real process: SGLang's contract, a real prefix cache, seeded tokens, a latency model.

Every figure here comes from the simulation, not from a model.
"""

from __future__ import annotations

import contextlib
import threading
import time
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
    assert float(rate.rpartition(" ")[2]) == pytest.approx(80 / prompt), "the last prefill batch: the warm prompt"
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


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith(f"sglang:{name}{{")).rpartition(" ")[2])


def wait_for_counts(url: str, running: int, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]
        if (state["num_running_reqs"], state["num_queue_reqs"]) == (running, waiting):
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine did not reach {running} running and {waiting} waiting within {timeout}s")


def post_in_background(url: str, body: dict[str, object], read_timeout: float) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(url + "/generate", json=body, timeout=httpx.Timeout(10, read=read_timeout))

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def test_gauges_follow_requests_aborted_during_a_pause(start_sim: Callable[..., str]) -> None:
    url = start_sim("--sim-decode-ms-per-step", "50")
    long = {"sampling_params": {"max_new_tokens": 2000}}
    leaving = [post_in_background(url, {"text": f"req {i}", **long}, read_timeout=1.5) for i in range(3)]
    wait_for_counts(url, 3, 0)
    assert httpx.post(url + "/pause_generation", json={"mode": "retract"}, timeout=10).status_code == 200
    for worker in leaving:
        worker.join(timeout=30)
    # Their clients left while paused: aborted, with no decode step after.
    wait_for_counts(url, 0, 0)
    assert [gauge(url, name) for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens")] == [0, 0, 0]


def test_gauges_count_requests_queued_during_a_pause(start_sim: Callable[..., str]) -> None:
    url = start_sim()
    assert httpx.post(url + "/pause_generation", json={"mode": "retract"}, timeout=10).status_code == 200
    held = [post_in_background(url, {"text": f"q {i}", "sampling_params": {"max_new_tokens": 2}}, 30) for i in (0, 1)]
    wait_for_counts(url, 0, 2)
    assert gauge(url, "num_queue_reqs") == 2
    assert httpx.post(url + "/continue_generation", timeout=10).status_code == 200
    for worker in held:
        worker.join(timeout=30)
    assert [gauge(url, name) for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens")] == [0, 0, 0]


def test_cache_hit_rate_is_the_last_prefill_batchs(start_sim: Callable[..., str]) -> None:
    url = start_sim("--sim-decode-ms-per-step", "1")
    params = {"max_new_tokens": 1}
    for question in ("12+7=", "12+8=", "12+9="):
        generate(url, {"text": SYSTEM + question, "sampling_params": params})
    prompt = len(SYSTEM) + 5
    assert gauge(url, "cache_hit_rate") == pytest.approx(80 / prompt)
    httpx.post(url + "/flush_cache", timeout=10)
    generate(url, {"text": "an unrelated prompt that shares nothing with the ones before", "sampling_params": params})
    assert gauge(url, "cache_hit_rate") == 0.0, "a since-start ratio would still show the earlier hits"
