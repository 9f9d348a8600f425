"""Cache-aware routing in front of `sim` engines running as real processes (simulated caches and latency)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from router_fakes import RunningRouter, metric_value

from rlfleet.processes import ServiceProcess, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture
def sim_engines(tmp_path: Path) -> Iterator[Callable[[int], list[str]]]:
    started: list[ServiceProcess] = []

    def start(count: int) -> list[str]:
        urls = []
        for _ in range(count):
            port = free_port()
            argv = [sys.executable, "-m", "rlfleet_engine", "--backend", "sim", "--model-path", "sim"]
            argv += ["--port", str(port), "--sim-decode-ms-per-step", "5"]
            started.append(ServiceProcess("sim-engine", argv, tmp_path / f"sim-{port}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for process, url in zip(started[-count:], urls, strict=True):
            process.wait_healthy(url + "/health", timeout=30)
        return urls

    yield start
    for process in started:
        process.stop(timeout=10)


def family_prompt(family: int, question: int) -> list[int]:
    """GRPO-like: a long prefix per prompt family, a short distinct tail."""
    return [1000 + family] * 200 + [question + 1, 7, 7]


def test_repeats_follow_the_cache_and_an_overloaded_engine_spills_over(
    sim_engines: Callable[[int], list[str]], start_router: Callable[..., RunningRouter]
) -> None:
    urls = sim_engines(3)
    # No bound on the groups an engine takes since the last flush: a family of four questions stays on one of
    # three idle engines (with the default slack of 2 its fourth question would go to another).
    router = start_router(
        urls, policy="cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5, balance_placement_slack=100
    )
    router.wait_healthy(3)

    def send(family: int, question: int, max_new_tokens: int = 4) -> tuple[str, dict[str, object]]:
        body = {"input_ids": family_prompt(family, question), "sampling_params": {"max_new_tokens": max_new_tokens}}
        answer = router.client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-rlfleet-engine"], answer.json()["meta_info"]

    homes = {}
    for family in range(3):
        served = [send(family, q) for q in range(4)]
        engines = {engine for engine, _ in served}
        assert len(engines) == 1, f"family {family} was spread over {engines}"
        homes[family] = engines.pop()
        assert served[0][1]["cached_tokens"] == 0
        assert all(meta["cached_tokens"] == 192 for _, meta in served[1:]), "whole 16-token blocks of the prefix"
    assert len(set(homes.values())) == 3, "new families go to the least-loaded engine"

    # 12 long requests of one family at once: its engine takes a few, the others absorb the rest.
    with ThreadPoolExecutor(max_workers=12) as pool:
        served = list(pool.map(lambda q: send(0, 100 + q, max_new_tokens=60), range(12)))
    per_engine = Counter(engine for engine, _ in served)
    assert per_engine[homes[0]] >= 3, f"the family's engine keeps serving it: {per_engine}"
    assert len(per_engine) >= 2 and max(per_engine.values()) <= 8, f"load spread: {per_engine}"

    text = router.client.get("/metrics").text
    assert (metric_value(text, "rlfleet_router_routing_decisions_total", {"reason": "cache_hit"}) or 0) >= 9
    assert (metric_value(text, "rlfleet_router_routing_decisions_total", {"reason": "imbalance"}) or 0) >= 1
    cached = sum(metric_value(text, "rlfleet_router_cached_tokens_total", {"engine": u}) or 0 for u in urls)
    prompt = sum(metric_value(text, "rlfleet_router_prompt_tokens_total", {"engine": u}) or 0 for u in urls)
    assert prompt == 24 * 203 and cached >= 9 * 192
    assert 0 < (metric_value(text, "rlfleet_router_tree_tokens") or 0) <= 2**24
    assert (metric_value(text, "rlfleet_router_added_latency_seconds_count") or 0) == 24


def test_conversations_stay_with_their_history_and_text_is_priced_in_the_engines_tokens(
    sim_engines: Callable[[int], list[str]], start_router: Callable[..., RunningRouter]
) -> None:
    urls = sim_engines(2)
    router = start_router(urls, policy="cache_aware")
    router.wait_healthy(2)
    system = "You are a terse assistant who answers with one number. " * 6
    for conversation in range(4):
        history, engines, answered = system, [], 0
        for turn in range(3):
            history += f"\nUser: what is {conversation} + {turn}?\nAssistant:"
            body = {"text": history, "sampling_params": {"max_new_tokens": 8}}
            answer = router.client.post("/generate", json=body)
            assert answer.status_code == 200, answer.text
            meta = answer.json()["meta_info"]
            assert meta["prompt_tokens"] == len(history), "the sim engine makes a token of each character"
            if turn:  # the previous turn's prompt and answer are cached where it ran: whole 16-token blocks
                assert meta["cached_tokens"] == answered // 16 * 16, (conversation, turn)
            engines.append(answer.headers["x-rlfleet-engine"])
            history += answer.json()["text"]
            answered = len(history)
        assert len(set(engines)) == 1, f"conversation {conversation} moved: {engines}"
    # Twelve answers of ~400 characters in as many tokens: the estimate has left its default of 4 for about 1.
    estimate = metric_value(router.client.get("/metrics").text, "rlfleet_router_chars_per_token")
    assert estimate is not None and estimate < 2, estimate


def test_a_flush_or_a_weight_load_through_the_router_empties_its_tree_as_it_empties_the_engines(
    sim_engines: Callable[[int], list[str]], start_router: Callable[..., RunningRouter]
) -> None:
    urls = sim_engines(2)
    router = start_router(urls, policy="cache_aware")
    router.wait_healthy(2)

    def send(question: int) -> dict[str, object]:
        body = {"input_ids": family_prompt(0, question), "sampling_params": {"max_new_tokens": 2}}
        answer = router.client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["meta_info"]

    def tree_tokens() -> float:
        return metric_value(router.client.get("/metrics").text, "rlfleet_router_tree_tokens") or 0

    def low_matches() -> float:
        text = router.client.get("/metrics").text
        return metric_value(text, "rlfleet_router_routing_decisions_total", {"reason": "low_match"}) or 0

    send(0)
    for question, empty in (
        (10, lambda: router.client.post("/flush_cache")),
        (
            20,
            lambda: router.client.post("/update_weights_from_disk", json={"model_path": "sim", "weight_version": "2"}),
        ),
    ):
        assert send(question)["cached_tokens"] == 192, "the family's prefix is cached where the tree says"
        assert tree_tokens() > 0
        before = low_matches()
        answer = empty()
        assert answer.status_code == 200, answer.text
        assert tree_tokens() == 0, "the engines hold nothing now, and neither does the tree"
        assert send(question + 1)["cached_tokens"] == 0
        assert low_matches() == before + 1, "routed as a prompt no engine holds"


@pytest.mark.parametrize(("stagger_ms", "cached"), [(400, [0, 320, 320, 320]), (0, [0, 0, 0, 0])])
def test_a_group_sent_at_once_is_staggered_so_its_later_samples_find_the_prompt_cached(
    sim_engines: Callable[[int], list[str]],
    start_router: Callable[..., RunningRouter],
    stagger_ms: int,
    cached: list[int],
) -> None:
    """SGLang (and the sim) share nothing within one prefill batch: four samples of a prompt that reach an engine
    before its next iteration each compute all of it. Staggered, the later three arrive once the first's prefill
    has begun. The engine is paused while the group arrives and continued 150 ms after the first was sent, a
    busy engine's iteration made long and deterministic: the stagger must outlast it."""
    urls = sim_engines(1)
    router = start_router(urls, policy="cache_aware", prefill_stagger_ms=stagger_ms)
    router.wait_healthy(1)
    prompt = [3000] * 300 + list(range(1, 22))  # 321 tokens: 20 whole blocks, the last token always computed

    def send(prompt: list[int]) -> int:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
        answer = router.client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["meta_info"]["cached_tokens"])

    with ThreadPoolExecutor(max_workers=4) as pool:
        # Distinct prompts first: the client's and the router's connections are open when the group is sent.
        assert list(pool.map(send, [[4000 + n] * 40 for n in range(4)])) == [0, 0, 0, 0]
        assert router.client.post("/pause_generation", json={}).status_code == 200
        start = threading.Barrier(5)

        def send_together(_: int) -> int:
            start.wait(timeout=10)
            return send(prompt)

        group = pool.map(send_together, range(4))
        start.wait(timeout=10)
        time.sleep(0.15)
        assert router.client.post("/continue_generation", json={}).status_code == 200
        assert sorted(group) == cached
    staggers = metric_value(router.client.get("/metrics").text, "rlfleet_router_prefill_staggers_total")
    assert staggers == (3 if stagger_ms else 0)
