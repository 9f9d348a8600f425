"""`rlfleet submit|runs|watch|cancel`: the Runs API from the command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from rlfleet.api_token import TOKEN_ENV, TOKEN_FILE_ENV, client_token, read_token_file
from rlfleet.runs_client import FINAL_STATES, RunsClient, load_spec_file
from rlfleet.v1.runs_pb2 import Run, RunState

DEFAULT_URL = os.environ.get("RLFLEET_API_URL", "http://127.0.0.1:8000")


def register(areas: argparse._SubParsersAction) -> None:
    submit = areas.add_parser("submit", help="submit a run spec (JSON or YAML) and print its id")
    submit.add_argument("spec", type=Path, help="RunSpec file (.json, .yaml or .yml)")
    submit.add_argument("--watch", action="store_true", help="watch the run until it ends")
    submit.set_defaults(func=run_submit)
    runs = areas.add_parser("runs", help="list runs")
    runs.add_argument("--state", help="only runs in this state (e.g. RUN_STATE_RUNNING)")
    runs.set_defaults(func=run_list)
    watch = areas.add_parser("watch", help="show a run's progress live until it ends")
    watch.add_argument("run_id")
    watch.set_defaults(func=run_watch)
    cancel = areas.add_parser("cancel", help="cancel a queued or running run")
    cancel.add_argument("run_id")
    cancel.set_defaults(func=run_cancel)
    for parser in (submit, runs, watch, cancel):
        parser.add_argument("--api", default=DEFAULT_URL, help=f"orchestrator URL (default {DEFAULT_URL})")
        parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer")
        parser.add_argument(
            "--api-token-file",
            type=Path,
            help=f"file holding the API token (default: ${TOKEN_FILE_ENV}, else the token in ${TOKEN_ENV})",
        )


def client_for(args: argparse.Namespace) -> RunsClient:
    token = read_token_file(args.api_token_file) if args.api_token_file else client_token()
    return RunsClient(args.api, timeout_s=args.timeout, token=token)


def state_name(state: int) -> str:
    return RunState.Name(state).removeprefix("RUN_STATE_").lower()


def progress_line(run: Run) -> str:
    p = run.progress
    accuracy = f"{run.evals[-1].accuracy:.3f}" if run.evals else "-"
    width = 24
    done = int(width * p.step / p.total_steps) if p.total_steps else 0
    bar = "#" * done + "." * (width - done)
    return (
        f"{run.id} [{bar}] step {p.step}/{p.total_steps}  reward {p.mean_reward:.3f}  "
        f"eval acc {accuracy}  weights v{p.weight_version}  {state_name(run.state)}"
    )


def watch_until_done(client: RunsClient, run_id: str, out: TextIO) -> Run:
    """Prints the run's progress (rewriting one line on a terminal) and returns the final run."""
    live = out.isatty()
    last: Run | None = None
    for run in client.watch(run_id, timeout_s=600.0):
        line = progress_line(run)
        out.write(f"\r{line}\033[K" if live else line + "\n")
        out.flush()
        last = run
        if run.state in FINAL_STATES:
            break
    if live:
        out.write("\n")
    if last is None or last.state not in FINAL_STATES:
        last = client.get(run_id)
    if last.error:
        out.write(f"error: {last.error}\n")
    return last


def run_submit(args: argparse.Namespace) -> int:
    client = client_for(args)
    run = client.submit(load_spec_file(args.spec))
    print(run.id)
    if args.watch:
        final = watch_until_done(client, run.id, sys.stdout)
        return 0 if final.state == RunState.RUN_STATE_SUCCEEDED else 1
    return 0


def run_list(args: argparse.Namespace) -> int:
    runs = client_for(args).list(args.state)
    print(f"{'ID':<20} {'STATE':<10} {'STEP':>9} {'REWARD':>7} {'EVAL ACC':>8}  NAME")
    for run in runs:
        accuracy = f"{run.evals[-1].accuracy:.3f}" if run.evals else "-"
        step = f"{run.progress.step}/{run.progress.total_steps}"
        print(
            f"{run.id:<20} {state_name(run.state):<10} {step:>9} {run.progress.mean_reward:>7.3f} "
            f"{accuracy:>8}  {run.spec.name}"
        )
    return 0


def run_watch(args: argparse.Namespace) -> int:
    final = watch_until_done(client_for(args), args.run_id, sys.stdout)
    return 0 if final.state == RunState.RUN_STATE_SUCCEEDED else 1


def run_cancel(args: argparse.Namespace) -> int:
    run = client_for(args).cancel(args.run_id)
    print(f"{run.id} {state_name(run.state)}")
    return 0
