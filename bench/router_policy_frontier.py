"""Sweeps cache_aware's settings through the routing replay: what hit rate each reaches, at what balance and makespan.

The benchmark's hit targets on some workloads sit within a point of what any router can reach there at
max/mean <= 1.3 (`hit_ceiling`). This asks whether some setting of the shipped policy gets there anyway: it
replays every combination of the swept `PolicyOptions` values (`router_policy_replay.replay`, the same
traffic, seeds and engine model; a new policy object for each workload and seed) and compares each with
the model of sglang-router's cache_aware within each seed, as the benchmark does: hit rate in points
(median over seeds of the per-seed difference), makespan ratio (median), and max/mean load (the worst
seed, since the target holds for every run).

Per workload it prints the shipped settings, the settings on the frontier (no other setting has a hit rate
as high, a max/mean as low and a makespan ratio as low, one of them strictly), and the highest hit rate
reached within the balance target. Every figure is a replay of the sim engines' model. The model of
sglang-router spreads conversations more evenly than the real one often does (see router_policy_replay),
so the makespan ratios here are pessimistic for multi-turn, and the best row is judged on balance alone.

    .venv/bin/python bench/router_policy_frontier.py [--engines 4 8] [--workloads grpo multiturn]
        [--caches roomy] [--seeds 0 1 2 3 4] [--sweep cache_tokens_per_request=10,20,40,80 ...]

Record the printed figures in bench/router_vs_sglang_router.md, beside the run or change they inform.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass, fields

from router_policy_replay import REPLAY, Replay, bench_engine_config, make_policy, replay
from router_vs_sglang_router import BALANCE_TARGET, CACHES, Workload, grpo_workload, multiturn_workload, run_label

from rlfleet_router.policies import PolicyOptions

DEFAULT_SWEEP = {
    "cache_tokens_per_request": [10, 20, 40, 80],
    "balance_abs_threshold": [2, 4, 6, 10],
    "balance_rel_threshold": [1.0, 1.25, 1.5],
}
WORKLOADS = {"grpo": grpo_workload, "multiturn": multiturn_workload}
Settings = tuple[tuple[str, float | int], ...]


@dataclass(frozen=True)
class Outcome:
    """One setting on one workload, against the sglang-router model in the same seeds."""

    settings: Settings
    hit_gap: float
    """Median over seeds of (hit rate - the model's), in points."""
    makespan: float
    """Median over seeds of makespan / the model's."""
    balance: float
    """The worst seed's max/mean requests per engine."""

    def dominates(self, other: Outcome) -> bool:
        """At least as good on every printed figure and better on one (differences below print precision
        are not told apart, so a row never looks dominated by another it is listed beside)."""
        (hit, balance, makespan), (other_hit, other_balance, other_makespan) = self.figures(), other.figures()
        at_least = hit >= other_hit and balance <= other_balance and makespan <= other_makespan
        return at_least and self.figures() != other.figures()

    def figures(self) -> tuple[float, float, float]:
        """The figures as printed: hit to a tenth of a point, balance and makespan to hundredths."""
        return round(self.hit_gap, 1), round(self.balance, 2), round(self.makespan, 2)

    def row(self, label: str) -> str:
        named = " ".join(f"{name}={value}" for name, value in self.settings)
        return (
            f"  {label:9} hit {self.hit_gap:+5.1f} pt  makespan {self.makespan:4.2f}x  max/mean {self.balance:4.2f}  "
            f"{named}"
        )


def parse_sweep(text: str) -> tuple[str, list[float | int]]:
    """NAME=V1,V2,... for a numeric PolicyOptions field; values of the field's type."""
    name, _, values = text.partition("=")
    default = getattr(PolicyOptions(), name, None)
    numeric = {f.name for f in fields(PolicyOptions)} - {"seed", "max_tree_tokens"}
    if name not in numeric or not isinstance(default, (int, float)) or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME=V1,V2,... with NAME one of {', '.join(sorted(numeric))}")
    try:
        return name, [int(v) if isinstance(default, int) else float(v) for v in values.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc


def compare(runs: list[Replay], baseline: list[Replay], settings: Settings) -> Outcome:
    pairs = list(zip(runs, baseline, strict=True))
    return Outcome(
        settings,
        hit_gap=statistics.median((r.hit_rate - b.hit_rate) * 100 for r, b in pairs),
        makespan=statistics.median(r.makespan / b.makespan for r, b in pairs),
        balance=max(r.max_over_mean for r in runs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--caches", nargs="+", default=["roomy"], choices=list(CACHES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the default traffic, as the benchmark's")
    parser.add_argument(
        "--sweep", type=parse_sweep, action="append", default=[], help="NAME=V1,V2,... (default: see DEFAULT_SWEEP)"
    )
    args = parser.parse_args()
    sweep = dict(args.sweep) or DEFAULT_SWEEP
    shipped = tuple((name, getattr(PolicyOptions(), name)) for name in sweep)
    combos = [tuple(zip(sweep, values, strict=True)) for values in itertools.product(*sweep.values())]
    if shipped not in combos:
        combos.append(shipped)
    print(f"# cache_aware settings sweep ({REPLAY}); {len(combos)} settings; seeds {' '.join(map(str, args.seeds))}")
    print(
        f"# against the sglang-router cache_aware model, within each seed: hit in points and makespan ratio (medians "
        f"over seeds), max/mean of the worst seed (target <= {BALANCE_TARGET})"
    )
    for cache in args.caches:
        for engines in args.engines:
            for name in args.workloads:
                fleet = Fleet(engines, cache, {seed: WORKLOADS[name](seed, args.scale) for seed in args.seeds})
                baseline = fleet.runs("sglang-model", PolicyOptions(), "sglang:cache_aware")
                outcomes: list[Outcome] = []
                for done, settings in enumerate(combos, 1):
                    print(
                        f"\r{name} {engines} engines {cache}: setting {done}/{len(combos)}",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
                    ours = fleet.runs("cache_aware", PolicyOptions(**dict(settings)), "rlfleet:cache_aware")
                    outcomes.append(compare(ours, baseline, settings))
                print(file=sys.stderr)
                print(f"== {name}, {engines} engines, {cache} caches ==")
                report(outcomes, shipped)


@dataclass(frozen=True)
class Fleet:
    """One workload's replays: its engines, their caches, and its traffic per seed."""

    engines: int
    cache: str
    traffic: dict[int, Workload]

    def runs(self, policy: str, options: PolicyOptions, router: str) -> list[Replay]:
        """`policy` replayed on every seed, its prompts under `router`'s run label as in the benchmark."""
        salt = run_label(router, self.cache, self.engines)
        config = bench_engine_config(CACHES[self.cache])
        return [
            replay(make_policy(policy, options), self.engines, config, workload, seed, salt)
            for seed, workload in self.traffic.items()
        ]


def report(outcomes: list[Outcome], shipped: Settings) -> None:
    print(next(o for o in outcomes if o.settings == shipped).row("shipped"))
    frontier: dict[tuple[float, float, float], list[Outcome]] = {}
    for outcome in outcomes:
        if not any(other.dominates(outcome) for other in outcomes):
            frontier.setdefault(outcome.figures(), []).append(outcome)
    for figures in sorted(frontier, reverse=True):
        tied = frontier[figures]
        print(tied[0].row("frontier") + (f" (and {len(tied) - 1} more with these figures)" if tied[1:] else ""))
    balanced = [o for o in outcomes if o.balance <= BALANCE_TARGET]
    if balanced:
        best = max(balanced, key=lambda o: (o.figures()[0], -o.figures()[1], -o.figures()[2]))
        print(best.row("best") + f"  (max/mean <= {BALANCE_TARGET})")
    else:
        print(f"  best      no setting keeps max/mean <= {BALANCE_TARGET}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
