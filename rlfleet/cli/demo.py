"""`rlfleet demo`: from nothing to a model that got better at arithmetic through GRPO.

Steps: make the tiny model, SFT warm start, bring the fleet up (on free ports, so it never collides
with a running `rlfleet up`), submit examples/runs/arith-grpo.yaml on the warm-started model, watch
it to the end, write the summary to <out>/summary.json, and take the fleet down.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.cli.runs import progress_line
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.processes import command_line
from rlfleet.runs_client import FINAL_STATES, RunsClient, load_spec_file
from rlfleet.tiny_model import create_tiny_model
from rlfleet.v1.runs_pb2 import Run, RunState

REPO = Path(__file__).resolve().parents[2]


def register(areas: argparse._SubParsersAction) -> None:
    demo = areas.add_parser("demo", help="SFT warm start, then GRPO through the whole fleet, with a summary")
    demo.add_argument("--out", type=Path, default=Path(".rlfleet/demo"), help="demo directory (recreated)")
    demo.add_argument("--spec", type=Path, default=REPO / "examples/runs/arith-grpo.yaml", help="run spec to train")
    demo.add_argument("--sft-steps", type=int, default=400, help="SFT warm-start steps")
    demo.add_argument("--engines", type=int, default=2, help="engines to start")
    demo.set_defaults(func=run_demo)


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out: Path = args.out.resolve()
    spec = load_spec_file(args.spec)  # fail on a bad spec before any long work
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    say("1/5 creating the tiny model")
    params = create_tiny_model(out / "base")
    say(f"    {params / 1e6:.1f}M parameters in {out / 'base'}")

    say(f"2/5 SFT warm start ({args.sft_steps} steps)")
    arith = spec.dataset.arithmetic
    subprocess.run(
        command_line(
            sys.executable,
            "-m",
            "rlfleet_trainer",
            "sft",
            model_path=out / "base",
            out=out / "sft",
            steps=args.sft_steps,
            digits=arith.digits or 2,
            ops=arith.ops or "+",
            seed=spec.trainer.seed,
        ),
        check=True,
        timeout=1800,
        env={**os.environ, "RLFLEET_LOG_FORMAT": "text"},
    )

    say("3/5 bringing the fleet up (engines, router, reward hub, trainer, orchestrator)")
    ports = FleetPorts.free(args.engines)
    # Its own Redis prefix: an orchestrator of `rlfleet up` on the same Redis never sees the demo's runs.
    config = FleetConfig(
        model_path=out / "sft",
        engines=args.engines,
        state_dir=out / "fleet",
        ports=ports,
        redis_prefix="rlfleet-demo:",
    )
    with LocalFleet(config) as fleet:
        say(f"    Runs API {fleet.api_url}, router {fleet.router_url}, logs in {fleet.log_dir}")
        spec.model.path = str(out / "sft")
        spec.model.tokenizer_path = str(out / "sft")
        client = RunsClient(fleet.api_url)
        run = client.submit(spec)
        say(f"4/5 GRPO run {run.id}: {spec.schedule.steps} steps")
        final, rewards, diffs = watch(client, run.id)
    say("5/5 fleet stopped")
    summary = summarize(final, rewards, diffs, time.monotonic() - started, args.engines)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    say(f"summary written to {out / 'summary.json'}")
    return 0 if final.state == RunState.RUN_STATE_SUCCEEDED else 1


def watch(client: RunsClient, run_id: str) -> tuple[Run, dict[int, float], list[float]]:
    """Follows the run; returns it as it ended, the mean reward per step and the logprob diffs seen."""
    rewards: dict[int, float] = {}
    diffs: list[float] = []
    last = client.get(run_id)
    for run in client.watch(run_id, timeout_s=900.0):
        last = run
        if run.progress.groups_produced:
            rewards[int(run.progress.step)] = run.progress.mean_reward
        if "logprob_diff" in run.metrics:
            diffs.append(run.metrics["logprob_diff"])
        say("    " + progress_line(run))
        if run.state in FINAL_STATES:
            break
    if last.state not in FINAL_STATES:
        last = client.get(run_id)
    if last.error:
        say(f"run failed: {last.error}")
    return last, rewards, diffs


def summarize(run: Run, rewards: dict[int, float], diffs: list[float], wall: float, engines: int) -> dict:
    evals = list(run.evals)
    steps = sorted(rewards)
    return {
        "run_id": run.id,
        "state": RunState.Name(run.state).removeprefix("RUN_STATE_").lower(),
        "algorithm": run.spec.algorithm.name,
        "steps": int(run.progress.step),
        "eval_accuracy_before": evals[0].accuracy if evals else None,
        "eval_accuracy_after": evals[-1].accuracy if evals else None,
        "eval_size": evals[-1].size if evals else None,
        "mean_reward_first": rewards[steps[0]] if steps else None,
        "mean_reward_last": rewards[steps[-1]] if steps else None,
        "logprob_diff_max": max(diffs) if diffs else None,
        "wall_seconds": round(wall, 1),
        "engines": engines,
        "weight_version": int(run.progress.weight_version),
    }
