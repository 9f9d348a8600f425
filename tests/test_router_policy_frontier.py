"""The settings sweep's comparison: per seed against the sglang-router model, the worst seed's balance,
the frontier, and sweep values checked as they are parsed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from router_policy_frontier import Outcome, compare, parse_sweep, report  # noqa: E402
from router_policy_replay import Replay  # noqa: E402


def replay(hit_rate: float, makespan: float, per_engine: list[int]) -> Replay:
    return Replay(hit_rate, makespan, p50=0.5, p99=1.0, per_engine=per_engine, busy=0.9)


def outcome(hit_gap: float, makespan: float, balance: float, rate: int) -> Outcome:
    return Outcome((("cache_tokens_per_request", rate),), hit_gap, makespan, balance)


def test_comparison_is_per_seed_and_balance_is_the_worst_seed() -> None:
    ours = [replay(0.95, 8.0, [10, 10, 10, 10]), replay(0.96, 16.0, [13, 9, 9, 9]), replay(0.97, 7.0, [10, 10, 10, 10])]
    model = [replay(0.96, 10.0, [20, 20, 0, 0]), replay(0.98, 20.0, [20, 20, 0, 0]), replay(0.97, 10.0, [40, 0, 0, 0])]
    result = compare(ours, model, (("balance_abs_threshold", 6),))
    assert result.hit_gap == pytest.approx(-1.0)  # per seed -1, -2, 0
    assert result.makespan == pytest.approx(0.8)  # per seed 0.8, 0.8, 0.7: not a ratio of medians
    assert result.balance == pytest.approx(1.3)  # seed 1's 13 / 10


def test_report_lists_the_frontier_and_the_best_setting_within_the_balance_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shipped = outcome(-2.0, 0.60, 1.05, 40)
    dominated = outcome(-2.5, 0.70, 1.10, 80)
    stickier = outcome(-1.2, 0.75, 1.25, 20)
    stickiest = outcome(-0.5, 0.90, 1.60, 10)
    report([shipped, dominated, stickier, stickiest], shipped.settings)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  shipped") and "=40" in lines[0]
    frontier = [line for line in lines if line.startswith("  frontier")]
    assert [line.rsplit("=", 1)[1] for line in frontier] == ["10", "20", "40"]  # by hit rate, 80 left out
    assert lines[-1].startswith("  best") and "-1.2 pt" in lines[-1]  # 10 reaches more, at max/mean 1.60


def test_settings_that_print_alike_are_one_frontier_row(capsys: pytest.CaptureFixture[str]) -> None:
    first = outcome(-1.71, 0.70, 1.25, 40)
    second = outcome(-1.68, 0.70, 1.25, 20)  # both print -1.7 pt
    looser = outcome(-1.70, 0.70, 1.28, 80)  # prints the same hit rate at a worse balance
    report([first, second, looser], first.settings)
    frontier = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  frontier")]
    assert len(frontier) == 1 and frontier[0].endswith("(and 1 more with these figures)")


def test_the_best_setting_is_the_most_balanced_of_those_that_print_the_top_hit_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    higher = outcome(-0.76, 0.90, 1.19, 10)
    balanced = outcome(-0.80, 0.90, 1.17, 20)  # the same -0.8 pt as printed, at a lower max/mean
    report([higher, balanced], higher.settings)
    best = capsys.readouterr().out.splitlines()[-1]
    assert best.startswith("  best") and "max/mean 1.17" in best


@pytest.mark.parametrize(
    "text",
    [
        "cache_tokens_per_request",
        "seed=1,2",
        "max_tree_tokens=10",
        "nonsense=1",
        "cache_threshold=0.3,x",
        "balance_abs_threshold=2.5",
    ],
)
def test_a_sweep_names_a_numeric_setting_and_its_values(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=V1,V2|could not convert|invalid literal"):
        parse_sweep(text)


def test_sweep_values_take_the_setting_type() -> None:
    assert parse_sweep("balance_abs_threshold=2,6") == ("balance_abs_threshold", [2, 6])
    assert parse_sweep("balance_rel_threshold=1,1.25") == ("balance_rel_threshold", [1.0, 1.25])
