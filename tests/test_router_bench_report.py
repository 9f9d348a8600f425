"""The routing benchmark's report: routers are compared within each traffic seed, then over seeds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from router_vs_sglang_router import BASELINE, RunResult, grpo_workload, non_negative, report  # noqa: E402

OURS = "rlfleet:cache_aware"


def run(makespan: float, hit_rate: float, p99: float = 1.0) -> RunResult:
    return RunResult(makespan, hit_rate, p50=p99 / 2, p99=p99, max_over_mean=1.1, per_engine=[10, 11, 9, 10])


def test_ratios_and_targets_are_medians_of_per_seed_comparisons() -> None:
    # Seed 1's traffic is slow for every router: a ratio of medians over seeds would mix the seeds
    # (8 / 20 = 0.40x); per seed the ratios are 0.90, 0.80 and 0.70, so the median is 0.80x.
    runs = {
        0: {OURS: [run(9.0, 0.972)], BASELINE: [run(10.0, 0.980)]},
        1: {OURS: [run(16.0, 0.960)], BASELINE: [run(20.0, 0.980)]},
        2: {OURS: [run(7.0, 0.975)], BASELINE: [run(10.0, 0.980)]},
    }
    workloads = {seed: grpo_workload(seed, 1.0) for seed in runs}
    lines = report("grpo, 4 engines, roomy caches", runs, workloads, "roomy", 4)

    assert "seeds 0 1 2" in lines[0]
    ours = next(line for line in lines if line.startswith(OURS))
    assert "0.80x" in ours.split()
    targets = next(line for line in lines if line.startswith("targets:"))
    assert "hit -0.8 pt vs sg-ca (seeds -0.8 -2.0 -0.5) (need >= -1) met;" in targets
    assert "makespan 0.80x (seeds 0.90 0.80 0.70) (<= 0.85) met" in targets
    assert sum(line.startswith(f"  {OURS} seed ") for line in lines) == 3


def test_one_seed_reads_as_before() -> None:
    runs = {0: {OURS: [run(9.0, 0.970)], BASELINE: [run(10.0, 0.980)]}}
    lines = report("grpo, 4 engines, roomy caches", runs, {0: grpo_workload(0, 1.0)}, "roomy", 4)
    assert "(measured on sim engines; seed 0)" in lines[0]
    targets = next(line for line in lines if line.startswith("targets:"))
    assert "makespan 0.90x (<= 0.85) NOT MET" in targets and "seeds" not in targets
    assert not any(line.startswith("  ") for line in lines), "no per-run lines for a single run"


def test_latency_rounds_of_zero_skip_the_probe_and_negative_ones_are_refused() -> None:
    assert non_negative("0") == 0 and non_negative("200") == 200
    with pytest.raises(argparse.ArgumentTypeError, match="-1: must be 0 or more"):
        non_negative("-1")
