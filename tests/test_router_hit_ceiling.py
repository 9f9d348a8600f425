"""The routing benchmark's hit-rate ceiling: no router beats it on the sim engines' model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from router_policy_replay import bench_engine_config, make_policy, replay  # noqa: E402
from router_vs_sglang_router import (  # noqa: E402
    CACHES,
    QUESTION,
    Workload,
    grpo_workload,
    hit_ceiling,
    multiturn_workload,
    run_label,
)

from rlfleet_router.policies import PolicyOptions  # noqa: E402


def test_one_group_counts_its_blocks_once_and_every_tail() -> None:
    family = "f" * 64  # four whole 16-token blocks
    prompt = family + QUESTION + "x" * 13 + "\nAnswer:"  # 96 tokens: six whole blocks, no partial one
    workload = Workload("grpo", [prompt], [], samples=4, max_new_tokens=8)
    # One engine: the first sample prefills all 96 tokens, each later one finds 95 (the last is computed).
    assert hit_ceiling(workload, engines=1, salt="", max_over_mean=1.0) == pytest.approx(3 * 95 / (4 * 96))
    # Two engines with two requests each at most: the family's four blocks are prefilled twice.
    assert hit_ceiling(workload, engines=2, salt="", max_over_mean=1.0) == pytest.approx((3 * 95 - 64) / (4 * 96))
    # A load bound that lets one engine take everything costs nothing.
    assert hit_ceiling(workload, engines=2, salt="", max_over_mean=2.0) == pytest.approx(3 * 95 / (4 * 96))


@pytest.mark.parametrize("engines", [2, 4])
@pytest.mark.parametrize("cache", ["roomy", "tight"])
def test_no_policy_beats_the_ceiling_at_its_own_balance(engines: int, cache: str) -> None:
    config = bench_engine_config(CACHES[cache])
    for policy_name in ("cache_aware", "sglang-model", "least_load", "round_robin"):
        policy = make_policy(policy_name, PolicyOptions(seed=0))
        salt = run_label(f"rlfleet:{policy_name}", cache, engines)
        for workload in (grpo_workload(0, 0.25), multiturn_workload(0, 0.25)):
            run = replay(policy, engines, config, workload, seed=0, salt=salt)
            ceiling = hit_ceiling(workload, engines, salt, run.max_over_mean)
            assert run.hit_rate <= ceiling + 1e-12, (policy_name, workload.name, run.hit_rate, ceiling)
