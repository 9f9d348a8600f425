"""`rlfleet submit|runs|watch|cancel`: the Runs API from the command line.

The orchestrator (theirs and `show`'s, cli/show.py) is the one named by --api, else by $RLFLEET_API_URL, else
the fleet `rlfleet up` recorded in <state-dir>/fleet.json (so a fleet on other ports is found), else
http://127.0.0.1:8000. An error about the address says which of them gave it: a stale variable or fleet.json
would look like a fleet that is down.

`submit` sends its Submit with a fresh request_id (a UUID4) and, while nothing answers, the answer is lost or a 5xx
comes back, sends it again with the same request_id for up to 30 s: the orchestrator answers a repeat with the run
the first one made, so a retry never submits a second run.

`submit --dry-run` has the orchestrator make every check of a submit and prints the spec as it would run (YAML,
defaults filled in), then a `#` line saying it is valid and nothing was submitted; a bad spec fails as a submit
would (status 2).

`watch` and `submit --watch` follow the run across restarts of the orchestrator (`rlfleet up` restarts it
in seconds). Their exit status: 0 when the run succeeded, 1 when it failed or was cancelled, 2 on an error
(bad input, nothing answering), 3 when the watch could not be kept up while the run went on (it says
where the run was), 130 on Ctrl-C (the run goes on).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import TextIO

from rlfleet.api_token import TOKEN_ENV, TOKEN_FILE_ENV, client_token, read_token_file
from rlfleet.cli.arg_types import positive_float, positive_int
from rlfleet.cli.fleet import DEFAULT_STATE_DIR
from rlfleet.errors import NotFound, Unavailable
from rlfleet.local_fleet import owner_runs, read_state
from rlfleet.runs_client import (
    WATCH_READ_TIMEOUT_S,
    WATCH_RECONNECT_S,
    RunNotFound,
    RunsClient,
    load_spec_file,
    spec_yaml,
)
from rlfleet.v1.runs_pb2 import Run, RunState

API_URL_ENV = "RLFLEET_API_URL"
FALLBACK_URL = "http://127.0.0.1:8000"
WATCH_ENDED_EXIT = 3
"""Exit status of `watch` and `submit --watch` when the watch could not be kept up while the run went on."""
STALLED = "stalled"
"""What `runs` shows for a running run that makes no progress, and takes as a --state, though the API has no
such state: the runs listed are the running ones that are stalled."""
STATES = [
    state
    for name in RunState.keys()
    if name != "RUN_STATE_UNSPECIFIED"
    for state in ((name.removeprefix("RUN_STATE_").lower(),) + ((STALLED,) if name == "RUN_STATE_RUNNING" else ()))
]
"""What --state takes (in any case), as `runs` shows them."""


def register(areas: argparse._SubParsersAction) -> None:
    submit = areas.add_parser("submit", help="submit a run spec (JSON or YAML) and print its id")
    submit.add_argument("spec", type=Path, help="RunSpec file (.json is read as JSON, any other name as YAML)")
    watch_or_check = submit.add_mutually_exclusive_group()
    watch_or_check.add_argument("--watch", action="store_true", help="watch the run until it ends")
    watch_or_check.add_argument(
        "--dry-run",
        action="store_true",
        help="have the orchestrator check the spec as a submit would, and print it with its defaults filled in; "
        "nothing is submitted",
    )
    submit.add_argument(
        "--model-path",
        help="train this model instead of the spec's model.path; passed as given, so a relative path is resolved "
        "by the orchestrator and the trainer, against their working directory (for `rlfleet up`, the directory "
        "it was started in)",
    )
    submit.set_defaults(func=run_submit)
    runs = areas.add_parser("runs", help="list runs, newest first")
    runs.add_argument(
        "--state",
        type=str.lower,
        choices=STATES,
        metavar="STATE",
        help=f"only runs in this state: {', '.join(STATES)} ({STALLED}: running, but making no progress)",
    )
    runs.add_argument("--limit", type=positive_int, default=20, help="show at most this many runs, the newest")
    runs.add_argument("--all", action="store_true", help="show every run")
    runs.set_defaults(func=run_list)
    watch = areas.add_parser("watch", help="show a run's progress live until it ends")
    watch.add_argument("run_id")
    watch.set_defaults(func=run_watch)
    cancel = areas.add_parser("cancel", help="cancel a queued or running run")
    cancel.add_argument("run_id")
    cancel.set_defaults(func=run_cancel)
    for parser in (submit, runs, watch, cancel):
        add_api_options(parser, watches=parser in (submit, watch))


def add_api_options(parser: argparse.ArgumentParser, watches: bool = False) -> None:
    """The options that find the Runs API and talk to it (`client_for` reads them); `watches` when the command
    watches a run, whose --timeout bounds only the watch's start."""
    parser.add_argument(
        "--api",
        help=f"orchestrator URL (default: ${API_URL_ENV}, else the Runs API of the fleet recorded in "
        f"<state-dir>/fleet.json, else {FALLBACK_URL})",
    )
    parser.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="the state directory `rlfleet up` used"
    )
    watch_timeout = (
        f"; a watch starts only once the orchestrator has answered within it, then waits up to "
        f"{WATCH_READ_TIMEOUT_S:g} s for each event or keep-alive"
        if watches
        else ""
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=30.0,
        help=f"seconds to wait for connecting and for each answer{watch_timeout}",
    )
    parser.add_argument(
        "--api-token-file",
        type=Path,
        help=f"file holding the API token (default: ${TOKEN_FILE_ENV}, else the token in ${TOKEN_ENV})",
    )


def api_url(args: argparse.Namespace) -> tuple[str, str] | None:
    """The Runs API that --api, $RLFLEET_API_URL or the fleet recorded in the state dir names, if any, and which
    of them named it (`--api`, `$RLFLEET_API_URL`, `api_url in <state-dir>/fleet.json`). A fleet still starting
    (`rlfleet up` making its model, or starting its services) is Unavailable, saying so: its Runs API does not
    answer yet, and before its address is known the default one could be another fleet's."""
    if args.api:
        return str(args.api), "--api"
    if os.environ.get(API_URL_ENV):
        return os.environ[API_URL_ENV], f"${API_URL_ENV}"
    state = read_state(args.state_dir)
    record = Path(args.state_dir) / "fleet.json"
    starting = state is not None and state.get("state") == "starting" and owner_runs(state)
    if state and state.get("api_url") and not starting:
        return str(state["api_url"]), f"api_url in {record}"
    if state and not owner_runs(state):
        raise Unavailable(
            f"the fleet recorded in {record} never got as far as its Runs API: the `rlfleet up` that was starting it "
            f"(pid {state.get('pid')}) is gone; start the fleet again, or run `rlfleet down --state-dir "
            f"{args.state_dir}` to clear what is left of it"
        )
    if state:
        raise Unavailable(
            f"the fleet recorded in {record} is still starting and its Runs API is not up yet; "
            'try again once `rlfleet up` prints "fleet is up"'
        )
    return None


def address_flags(args: argparse.Namespace) -> str:
    """The flags that found the Runs API `args` name, for a command to be run again: "" for the default fleet or
    $RLFLEET_API_URL (both still there for the next command)."""
    if getattr(args, "api", None):
        return f" --api {args.api}"
    state_dir = getattr(args, "state_dir", None)
    return "" if state_dir is None or Path(state_dir) == DEFAULT_STATE_DIR else f" --state-dir {state_dir}"


def client_for(args: argparse.Namespace) -> RunsClient:
    token = read_token_file(args.api_token_file) if args.api_token_file else client_token()
    record = Path(args.state_dir) / "fleet.json"
    named = api_url(args)
    if named is None:
        url = FALLBACK_URL
        where = "" if Path(args.state_dir) == DEFAULT_STATE_DIR else f" --state-dir {args.state_dir}"
        unreachable = (
            f". No fleet is recorded in {record}, so the default address was tried: start a fleet with "
            f"`rlfleet up{where}`, give the --state-dir the running fleet was started with, or name its Runs API "
            f"with --api or ${API_URL_ENV}"
        )
        not_runs_api = unreachable
    else:
        url, source = named
        unreachable = f"; the address came from {source}"
        wanted = f"the orchestrator's REST URL (api_url in {record})"
        if source == "--api":
            not_runs_api = f"; --api wants {wanted}"
        elif source == f"${API_URL_ENV}":
            not_runs_api = f"; the address came from {source}, which must name {wanted}"
        else:
            not_runs_api = f"; the address came from {source}: the fleet recorded there may be gone"
    return RunsClient(
        url, timeout_s=args.timeout, token=token, unreachable_hint=unreachable, not_runs_api_hint=not_runs_api
    )


def state_name(run: Run) -> str:
    """The run's state, `stalled` for a running run the orchestrator reports as making no progress."""
    if run.stalled and run.state == RunState.RUN_STATE_RUNNING:
        return STALLED
    return RunState.Name(run.state).removeprefix("RUN_STATE_").lower()


def eval_failures(run: Run) -> str:
    """How many samples the run's last evaluation lost to failures ("" when none): its accuracy counts them as
    wrong answers, and without the count a failing fleet reads as a model that got worse."""
    last = run.evals[-1] if run.evals else None
    return f"{last.failed} of {last.size * last.k} eval samples failed" if last and last.failed else ""


def progress_line(run: Run) -> str:
    p = run.progress
    accuracy = f"{run.evals[-1].accuracy:.3f}" if run.evals else "-"
    if failures := eval_failures(run):
        accuracy += f" ({failures})"
    width = 24
    done = int(width * p.step / p.total_steps) if p.total_steps else 0
    bar = "#" * done + "." * (width - done)
    return (
        f"{run.id} [{bar}] step {p.step}/{p.total_steps}  reward {p.mean_reward:.3f}  "
        f"eval acc {accuracy}  weights v{p.weight_version}  {state_name(run)}"
    )


class WatchInterrupted(KeyboardInterrupt):
    """Ctrl-C on a watch: the watch ends, the run goes on."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


def watch_until_done(client: RunsClient, run_id: str, out: TextIO, reconnect_within_s: float) -> Run:
    """Prints the run's progress (rewriting one line on a terminal) and returns the final run; WatchEnded when
    the watch cannot be started again within `reconnect_within_s` after the orchestrator ended it. A stall, and
    the run moving again, get lines of their own: the progress line alone would look the same; so does a lost
    watch that is tried again (it can take minutes to notice a hung orchestrator and give up). Off a
    terminal a line is printed only when it differs from the one before: a step brings several events
    (groups produced, scored, trained) that the progress line does not tell apart."""
    live = out.isatty()
    last: Run | None = None
    shown = ""

    def lost(note: str) -> None:
        nonlocal shown
        out.write(f"\r\033[K{note}\n" if live else f"{note}\n")
        out.flush()
        shown = ""

    try:
        for run in client.follow(run_id, reconnect_within_s, on_lost=lost):
            if run.stalled != (last.stalled if last else ""):
                note = f"stalled: {run.stalled}" if run.stalled else "moving again"
                out.write(f"\r\033[K{run.id} {note}\n" if live else f"{run.id} {note}\n")
                shown = ""
            line = progress_line(run)
            if live:
                out.write(f"\r{line}\033[K")
            elif line != shown:
                out.write(line + "\n")
            shown = line
            out.flush()
            last = run
    except KeyboardInterrupt:
        raise WatchInterrupted(run_id) from None
    finally:
        if live:
            out.write("\n")
    assert last is not None, "follow() yields the run before it returns"
    if last.error:
        out.write(f"error: {last.error}\n")
    return last


def run_submit(args: argparse.Namespace) -> int:
    client = client_for(args)
    spec = load_spec_file(args.spec)
    if args.model_path:
        spec.model.path = args.model_path

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.dry_run:
        print(spec_yaml(client.submit(spec, validate_only=True, on_retry=say).spec), end="")
        print(f"# {args.spec} is valid (the spec above is it with every default filled in); nothing was submitted")
        return 0
    # One request_id for this invocation: every retry of the Submit repeats it, so none makes a second run.
    run = client.submit(spec, request_id=str(uuid.uuid4()), on_retry=say)
    print(run.id)
    if args.watch:
        final = watch_until_done(client, run.id, sys.stdout, WATCH_RECONNECT_S)
        return 0 if final.state == RunState.RUN_STATE_SUCCEEDED else 1
    return 0


def run_list(args: argparse.Namespace) -> int:
    stalled_only = (args.state or "").lower() == STALLED
    runs = client_for(args).list("running" if stalled_only else args.state)[::-1]  # the API lists oldest first
    if stalled_only:
        runs = [run for run in runs if state_name(run) == STALLED]
    shown = runs if args.all else runs[: args.limit]
    print(f"{'ID':<20} {'STATE':<10} {'STEP':>9} {'REWARD':>7} {'EVAL ACC':>8}  NAME")
    for run in shown:
        accuracy = f"{run.evals[-1].accuracy:.3f}" if run.evals else "-"
        step = f"{run.progress.step}/{run.progress.total_steps}"
        print(
            f"{run.id:<20} {state_name(run):<10} {step:>9} {run.progress.mean_reward:>7.3f} "
            f"{accuracy:>8}  {run.spec.name}"
        )
    for run in shown:
        if state_name(run) == STALLED:
            print(f"{run.id} stalled: {run.stalled}")
        if failures := eval_failures(run):
            print(f"{run.id} {failures}")
    if len(shown) < len(runs):
        print(f"(the newest {len(shown)} of {len(runs)} runs; --limit N or --all shows more)")
    return 0


def run_watch(args: argparse.Namespace) -> int:
    client = client_for(args)
    try:
        final = watch_until_done(client, args.run_id, sys.stdout, WATCH_RECONNECT_S)
    except RunNotFound:
        raise no_such_run(args, client.base_url) from None
    return 0 if final.state == RunState.RUN_STATE_SUCCEEDED else 1


def run_cancel(args: argparse.Namespace) -> int:
    client = client_for(args)
    try:
        run = client.cancel(args.run_id)
    except RunNotFound:
        raise no_such_run(args, client.base_url) from None
    print(f"{run.id} {state_name(run)}")
    return 0


def no_such_run(args: argparse.Namespace, base_url: str) -> NotFound:
    """The error for a run `args.run_id` the orchestrator at `base_url` does not hold, saying where that address
    came from: a stale $RLFLEET_API_URL or fleet.json names another fleet, which holds other runs."""
    named = api_url(args)
    source = (
        f"the address came from {named[1]}"
        if named
        else f"the default address, as no fleet is recorded in {Path(args.state_dir) / 'fleet.json'}"
    )
    return NotFound(
        f"no run {args.run_id!r} at {base_url} ({source}); `rlfleet runs{address_flags(args)}` lists the runs it holds"
    )
