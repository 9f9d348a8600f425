"""Async speedup: wall time to a held-out accuracy with max_staleness 0 (on-policy) and 1, in one fleet.

Makes the tiny model, warm-starts it with SFT (as `rlfleet demo` does), brings the whole local
fleet up once, then trains the demo task (examples/runs/arith-grpo.yaml) twice from the same warm
start and seed: with rollout.max_staleness 0, then 1. Each run's evaluations are timed from the run
start; the target is the best accuracy both runs reach (or --target), above the warm start's (step 0's
evaluation), and each run's time to target is the time of its first evaluation at or above it.
Prints both times and their ratio. A run still going after --run-timeout seconds (1800) is cancelled
and ends the benchmark.

    .venv/bin/python bench/async_speedup.py [--steps 40] [--eval-every 4] [--target 0.5] [--run-timeout 1800]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

from rlfleet.cli.arg_types import positive_float
from rlfleet.cli.demo import recreate
from rlfleet.cli.down import delete_keys
from rlfleet.cli.steps import warm_start
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.runs_client import FINAL_STATES, RunsClient, load_spec_file
from rlfleet.v1.runs_pb2 import RunSpec, RunState

REPO = Path(__file__).resolve().parents[1]
# A prefix of this run's own: runs an earlier, killed bench left queued under its prefix are never resumed here.
REDIS_PREFIX = f"rlfleet-bench-async-{uuid.uuid4().hex[:8]}:"


def timed_run(client: RunsClient, spec: RunSpec, timeout_s: float) -> list[tuple[float, int, float]]:
    """Submits `spec` and follows it to the end, cancelling it after `timeout_s`; (seconds since RUNNING, step,
    accuracy) per evaluation."""
    run = client.submit(spec)
    started: float | None = None
    seen: list[tuple[float, int, float]] = []
    with client.cancel_after(run.id, timeout_s) as timed_out:
        for current in client.watch(run.id, timeout_s=900.0):
            if started is None and current.state == RunState.RUN_STATE_RUNNING:
                started = time.monotonic()
            for ev in current.evals[len(seen) :]:
                seen.append((time.monotonic() - (started or time.monotonic()), int(ev.step), ev.accuracy))
                print(
                    f"[{spec.name}] eval at step {ev.step}: accuracy {ev.accuracy:.3f} ({seen[-1][0]:.0f} s)",
                    flush=True,
                )
            if current.state in FINAL_STATES:
                if current.state == RunState.RUN_STATE_SUCCEEDED:
                    return seen
                if timed_out.is_set():
                    raise SystemExit(f"run {run.id} had not ended after {timeout_s:g} s; cancelled it")
                raise SystemExit(f"run {run.id} ended {RunState.Name(current.state)}: {current.error}")
    raise SystemExit(f"run {run.id} did not end")


def time_to(evals: list[tuple[float, int, float]], target: float) -> tuple[float, int]:
    reached = next(((t, step) for t, step, acc in evals if acc >= target - 1e-9), None)
    if reached is None:
        raise SystemExit(f"a run never reached accuracy {target}; lower --target or raise --steps")
    return reached


def say(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".rlfleet/bench-async"))
    parser.add_argument("--spec", type=Path, default=REPO / "examples/runs/arith-grpo.yaml")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--target", type=float, default=None, help="accuracy to reach (default: best both reach)")
    parser.add_argument(
        "--run-timeout", type=positive_float, default=1800.0, help="seconds a run may take before it is cancelled"
    )
    parser.add_argument("--overwrite", action="store_true", help="delete --out even when it is not an earlier run's")
    args = parser.parse_args()

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
    results: dict[int, list[tuple[float, int, float]]] = {}
    try:
        with LocalFleet(config) as fleet:
            client = RunsClient(fleet.api_url)
            for staleness in (0, 1):
                spec = RunSpec()
                spec.CopyFrom(base)
                spec.name = f"async-speedup-s{staleness}"
                spec.model.path = spec.model.tokenizer_path = str(sft)
                spec.rollout.max_staleness = staleness
                spec.schedule.steps, spec.schedule.eval_every = args.steps, args.eval_every
                spec.dataset.eval_size = args.eval_size
                print(f"training with max_staleness {staleness} ({args.steps} steps)", flush=True)
                results[staleness] = timed_run(client, spec, args.run_timeout)
                print(f"max_staleness {staleness}: evals (seconds, step, accuracy) {results[staleness]}", flush=True)
    finally:
        delete_keys(config.resolved_redis_url(), REDIS_PREFIX, print)
    target = args.target
    if target is None:
        target = min(max(acc for _, _, acc in evals) for evals in results.values())
    start = max(evals[0][2] for evals in results.values())  # step 0's: the warm start's accuracy
    if target <= start + 1e-9:  # reached before any training: the ratio would time nothing learnt
        raise SystemExit(
            f"accuracy {target:.3f} is no better than the warm start's ({start:.3f}): a run did not improve on it; "
            "raise --steps, or give a --target above it"
        )
    (sync_s, sync_step), (async_s, async_step) = time_to(results[0], target), time_to(results[1], target)
    summary = {
        "target_accuracy": round(target, 4),
        "sync_seconds": round(sync_s, 1),
        "sync_step": sync_step,
        "async_seconds": round(async_s, 1),
        "async_step": async_step,
        "speedup": round(sync_s / async_s, 3),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
