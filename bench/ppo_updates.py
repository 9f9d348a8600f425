"""Updates per batch: what trainer.mini_batches, trainer.epochs (and algorithm.tis_cap) do to learning, in one fleet.

Makes the tiny model, warm-starts it with SFT (as `rlfleet demo` does), brings the whole local fleet
up once, then trains the demo task (examples/runs/arith-grpo.yaml) once per variant from the same
warm start and seed. A variant is `MxE` (trainer.mini_batches M, trainer.epochs E), optionally with
`+tis` (algorithm.tis_cap 2.0: the PPO ratio of every update is then taken against the trainer's
log-probs before the step's first update, so the clip acts on the later updates) or `+tis=C`, and
optionally `+stale=K` (rollout.max_staleness K: generation runs up to K weight versions ahead of the
trainer, so the engines' log-probs come from an older policy than the one trained; 0 otherwise).

Per variant it records the held-out accuracy of every evaluation, the mean reward of the first and
last step, pg_clipfrac, tis_weight, logprob_diff (trainer against engine log-probs of the sampled tokens) and
optimizer_updates of each trainer step report the run's watch shows
(Run.metrics holds the latest step's; a watch may fold two quick changes into one, so a report can be
missed), the trainer's step_seconds and the run's wall time (RUNNING to its end, evaluations
included). The first variant is the baseline: the summary gives each other variant's accuracy gain
(after - before) over the baseline's gain, and its wall time over the baseline's. A run still going
after --run-timeout seconds (1800) is cancelled and ends the benchmark.

    .venv/bin/python bench/ppo_updates.py [--variants 1x1,4x1,4x1+tis,1x1+stale=1] [--steps 40] [--eval-every 10]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.cli.arg_types import positive_float
from rlfleet.cli.demo import recreate
from rlfleet.cli.down import delete_keys
from rlfleet.cli.steps import warm_start
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.runs_client import FINAL_STATES, RunsClient, load_spec_file
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState

REPO = Path(__file__).resolve().parents[1]
# A prefix of its own per run: two runs on one Redis (or a killed one's leftovers) never share keys.
REDIS_PREFIX = f"rlfleet-bench-ppo-{uuid.uuid4().hex[:8]}:"
DEFAULT_TIS_CAP = 2.0
VARIANT = re.compile(r"(\d+)x(\d+)(\+tis(?:=(\d+(?:\.\d*)?))?)?(?:\+stale=(\d+))?")


@dataclass(frozen=True)
class Variant:
    name: str
    mini_batches: int
    epochs: int
    tis_cap: float
    max_staleness: int = 0


def parse_variants(text: str) -> list[Variant]:
    variants = []
    for name in (part.strip() for part in text.split(",")):
        match = VARIANT.fullmatch(name)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"variant {name!r}: write MxE[+tis[=CAP]][+stale=K], e.g. 4x1+tis or 1x1+tis+stale=1"
            )
        tis = (float(match[4]) if match[4] else DEFAULT_TIS_CAP) if match[3] else 0.0
        variants.append(Variant(name, int(match[1]), int(match[2]), tis, int(match[5] or 0)))
    if len({v.name for v in variants}) != len(variants):
        raise argparse.ArgumentTypeError(f"--variants {text!r} names a variant twice")
    return variants


@dataclass
class Record:
    """What one variant's run showed."""

    evals: list[tuple[int, float]] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)
    reports: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0


def variant_spec(base: RunSpec, variant: Variant, model: Path, args: argparse.Namespace) -> RunSpec:
    spec = RunSpec()
    spec.CopyFrom(base)
    spec.name = f"ppo-updates-{variant.name.replace('+', '-').replace('=', '')}"
    spec.model.path = spec.model.tokenizer_path = str(model)
    spec.trainer.mini_batches, spec.trainer.epochs = variant.mini_batches, variant.epochs
    spec.algorithm.tis_cap = variant.tis_cap
    spec.rollout.max_staleness = variant.max_staleness
    spec.schedule.steps, spec.schedule.eval_every = args.steps, args.eval_every
    spec.dataset.eval_size = args.eval_size
    return spec


def train(client: RunsClient, spec: RunSpec, label: str, timeout_s: float) -> Record:
    """Submits `spec` and follows it to its end (each read of the watch is bounded, the whole run by `timeout_s`)."""
    run = client.submit(spec)
    record, last = Record(), Run()
    with client.cancel_after(run.id, timeout_s) as timed_out:
        for last in client.follow(run.id):
            if last.progress.groups_produced:
                record.rewards[int(last.progress.step)] = last.progress.mean_reward
            if last.metrics and (not record.reports or dict(last.metrics) != record.reports[-1]):
                metrics = dict(last.metrics)
                record.reports.append(metrics)
                print(
                    f"  [{label}] step report {len(record.reports)}/{last.progress.total_steps}: "
                    f"reward {metrics.get('reward_mean', 0.0):.3f} pg_clipfrac {metrics.get('pg_clipfrac', 0.0):.4f} "
                    f"logprob_diff {metrics.get('logprob_diff', 0.0):.2e} "
                    f"updates {metrics.get('optimizer_updates', 0.0):.0f} "
                    f"step {metrics.get('step_seconds', 0.0):.2f} s",
                    flush=True,
                )
            for ev in last.evals[len(record.evals) :]:
                record.evals.append((int(ev.step), ev.accuracy))
                print(f"  [{label}] eval at step {ev.step}: accuracy {ev.accuracy:.3f} ({ev.size} prompts)", flush=True)
            if last.state in FINAL_STATES:
                break
    if timed_out.is_set() and last.state != RunState.RUN_STATE_SUCCEEDED:
        raise SystemExit(f"run {run.id} ({label}) had not ended after {timeout_s:g} s; cancelled it")
    if last.state != RunState.RUN_STATE_SUCCEEDED:
        raise SystemExit(f"run {run.id} ({label}) ended {RunState.Name(last.state)}: {last.error}")
    record.wall_s = (last.finished_at.ToNanoseconds() - last.started_at.ToNanoseconds()) / 1e9
    return record


def mean(values: list[float], digits: int) -> float | None:
    return round(sum(values) / len(values), digits) if values else None


def summarize(variant: Variant, record: Record, steps: int) -> dict:
    steps_seen = sorted(record.rewards)
    return {
        "mini_batches": variant.mini_batches,
        "epochs": variant.epochs,
        "tis_cap": variant.tis_cap,
        "max_staleness": variant.max_staleness,
        "accuracy": {str(step): round(acc, 4) for step, acc in record.evals},
        "accuracy_gain": round(record.evals[-1][1] - record.evals[0][1], 4),
        "mean_reward_first": round(record.rewards[steps_seen[0]], 4) if steps_seen else None,
        "mean_reward_last": round(record.rewards[steps_seen[-1]], 4) if steps_seen else None,
        "step_reports_seen": len(record.reports),
        "pg_clipfrac_mean": mean([r["pg_clipfrac"] for r in record.reports if "pg_clipfrac" in r], 5),
        "tis_weight_mean": mean([r["tis_weight"] for r in record.reports if "tis_weight" in r], 5),
        "logprob_diff_mean": mean([r["logprob_diff"] for r in record.reports if "logprob_diff" in r], 6),
        "optimizer_updates": sorted({int(r["optimizer_updates"]) for r in record.reports if "optimizer_updates" in r}),
        "trainer_step_seconds_mean": mean([r["step_seconds"] for r in record.reports if "step_seconds" in r], 3),
        "run_seconds_per_step": round(record.wall_s / steps, 2),
        "wall_seconds": round(record.wall_s, 1),
    }


def say(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".rlfleet/bench-ppo-updates"))
    parser.add_argument("--spec", type=Path, default=REPO / "examples/runs/arith-grpo.yaml")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=parse_variants("1x1,4x1,4x1+tis"),
        help="comma-separated MxE[+tis[=CAP]][+stale=K] (mini_batches x epochs); the first is the baseline",
    )
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--run-timeout", type=positive_float, default=1800.0, help="seconds a variant's run may take")
    parser.add_argument("--overwrite", action="store_true", help="delete --out even when it is not an earlier run's")
    args = parser.parse_args()
    variants: list[Variant] = args.variants

    out: Path = args.out.resolve()
    try:  # a directory that holds files and is not an earlier run's is refused, not deleted
        recreate(out, args.overwrite)
    except FileExistsError as exc:
        parser.error(str(exc))
    base = load_spec_file(args.spec)
    sft = warm_start(base, out, args.sft_steps, ("making the tiny model", "warm-starting it with SFT"), say)
    config = FleetConfig(
        model_path=sft,
        engines=args.engines,
        state_dir=out / "fleet",
        ports=FleetPorts.free(args.engines),
        redis_prefix=REDIS_PREFIX,
    )
    specs = {v.name: variant_spec(base, v, sft, args) for v in variants}
    records: dict[str, Record] = {}
    try:
        with LocalFleet(config) as fleet:
            client = RunsClient(fleet.api_url)
            for spec in specs.values():  # every variant is refused now, not after the others trained
                client.submit(spec, validate_only=True)
            for variant in variants:
                print(f"training variant {variant.name} ({args.steps} steps)", flush=True)
                records[variant.name] = record = train(client, specs[variant.name], variant.name, args.run_timeout)
                print(f"  [{variant.name}] done: {json.dumps(summarize(variant, record, args.steps))}", flush=True)
            client.close()
    finally:
        delete_keys(config.resolved_redis_url(), REDIS_PREFIX, print)

    results = {v.name: summarize(v, records[v.name], args.steps) for v in variants}
    baseline = results[variants[0].name]
    for variant in variants[1:]:
        result = results[variant.name]
        result["gain_vs_baseline"] = (
            round(result["accuracy_gain"] / baseline["accuracy_gain"], 3) if baseline["accuracy_gain"] else None
        )
        result["wall_vs_baseline"] = round(result["wall_seconds"] / baseline["wall_seconds"], 3)
    summary = {"baseline": variants[0].name, "steps": args.steps, "eval_size": args.eval_size, "variants": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
