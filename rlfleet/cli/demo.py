"""`rlfleet demo`: from nothing to a model that got better at arithmetic through GRPO.

Steps: make the tiny model, SFT warm start, bring the fleet up (on free ports and under a Redis key
prefix of its own, so it never collides with a running `rlfleet up` or another demo), submit
examples/runs/arith-grpo.yaml on the warm-started model, watch it to the end, write the summary to
<out>/summary.json, and take the fleet down. Before any of it, the spec gets every check of a submit that needs
none of the fleet's services (local_spec_check.py): a misspelt reward function is not found minutes later.

<out> is recreated: it must be empty, absent, or a previous demo's (which holds the marker file the
demo writes first); anything else is deleted only with --overwrite, and never while the fleet recorded in
<out>/fleet/fleet.json still runs.

Ctrl-C, SIGTERM and SIGHUP (`rlfleet down --state-dir <out>/fleet` sends SIGTERM) stop the demo at any step,
its SFT child and its fleet included, and delete its Redis keys; it then exits with 128 + the signal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from rlfleet.cli.arg_types import engine_count, positive_int, redis_prefix
from rlfleet.cli.down import delete_keys
from rlfleet.cli.fleet import check_redis_url, left_running
from rlfleet.cli.runs import progress_line
from rlfleet.cli.steps import StepFailed, warm_start
from rlfleet.cli.stop_signals import StopSignal, raise_on_signals, stop_on_signals
from rlfleet.errors import InvalidInput
from rlfleet.fleet_supervisor import GaveUp, RestartPolicy, Supervisor
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet, record_starting, remove_own_record, running_fleet
from rlfleet.local_spec_check import check_spec_here
from rlfleet.processes import ServiceStartError, StartInterrupted
from rlfleet.redis_claim import refuse_if_held
from rlfleet.runs_client import FINAL_STATES, RunsClient, WatchEnded, load_spec_file
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState

REPO = Path(__file__).resolve().parents[2]
MARKER = ".rlfleet-demo"
"""Written first into the demo directory: only a directory holding it is deleted without --overwrite."""
DEMO_OUTPUTS = frozenset({MARKER, "base", "sft", "fleet", "summary.json"})


def register(areas: argparse._SubParsersAction) -> None:
    demo = areas.add_parser("demo", help="SFT warm start, then GRPO through the whole fleet, with a summary")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path(".rlfleet/demo"),
        help="demo directory, recreated: it must be empty, absent or a previous demo's",
    )
    demo.add_argument("--overwrite", action="store_true", help="delete --out even when it is not a previous demo's")
    demo.add_argument("--spec", type=Path, default=REPO / "examples/runs/arith-grpo.yaml", help="run spec to train")
    demo.add_argument("--sft-steps", type=positive_int, default=400, help="SFT warm-start steps")
    demo.add_argument("--engines", type=engine_count, default=2, help="engines to start")
    demo.add_argument("--redis-url", default=None, help="use this Redis instead of 127.0.0.1:6379 / a started one")
    demo.add_argument(
        "--redis-prefix",
        type=redis_prefix,
        default=None,
        help="prefix of the demo's Redis keys (default: rlfleet-demo-<random>: for each demo, its keys deleted at "
        "the end)",
    )
    demo.set_defaults(func=run_demo)


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out: Path = args.out.resolve()
    # A bad spec or Redis fails before any long work: the spec as far as the fleet's checks at submit need
    # none of its services (ranges, the names registered here, dataset files).
    spec = load_spec_file(args.spec)
    spec.model.path = spec.model.tokenizer_path = str(out / "sft")  # the demo trains its own warm start
    try:
        check_spec_here(spec)
    except InvalidInput as exc:
        raise InvalidInput(f"{args.spec}: {exc}") from None
    check_redis_url(args.redis_url)
    if args.redis_url and args.redis_prefix:  # else the prefix is the demo's own, or so is its Redis
        refuse_if_held(args.redis_url, args.redis_prefix)
    with raise_on_signals():  # until the fleet starts, a stop signal ends the step in progress at once
        recreate(out, args.overwrite)
        record_starting(out / "fleet")  # from here on `rlfleet down --state-dir <out>/fleet` stops this process
        say(f"stop it from another shell: rlfleet down --state-dir {out / 'fleet'}")
        try:
            fleet = prepare(args, spec, out)
        except BaseException:
            remove_own_record(out / "fleet")
            raise
    final, rewards, diffs = train_on_fleet(fleet, spec)
    if fleet.left_running:
        print(f"rlfleet: error: {left_running(fleet, fleet.left_running)}", file=sys.stderr, flush=True)
    else:
        say("5/5 fleet stopped")
    summary = summarize(final, rewards, diffs, time.monotonic() - started, args.engines)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    say(f"summary written to {out / 'summary.json'}")
    return 0 if final.state == RunState.RUN_STATE_SUCCEEDED and not fleet.left_running else 1


def prepare(args: argparse.Namespace, spec: RunSpec, out: Path) -> LocalFleet:
    """Steps 1-2, the tiny model and its SFT warm start, and the fleet that is to serve it (not started)."""
    warm_start(spec, out, args.sft_steps, ("1/5 creating the tiny model", "2/5 SFT warm start"), say)
    say("3/5 bringing the fleet up (engines, router, reward hub, trainer, orchestrator)")
    return LocalFleet(fleet_config(args, out))


def train_on_fleet(fleet: LocalFleet, spec: RunSpec) -> tuple[Run, dict[int, float], list[float]]:
    """Starts the fleet, trains `spec` on it to the end, and stops it; a stop signal stops it sooner (as
    StopSignal). The fleet's Redis keys are deleted afterwards when they are its scratch and the Redis is not
    the fleet's own (that one keeps its data under <out>, which the next demo deletes)."""
    with stop_on_signals(fleet) as received:  # a raise while the fleet starts could leave a child unrecorded
        try:
            try:
                fleet.start()
            except StartInterrupted:
                raise StopSignal(received[0] if received else signal.SIGTERM) from None
            except ServiceStartError as exc:
                raise StepFailed(f"3/5 the fleet did not start: {exc}") from None
            say(f"    Runs API {fleet.api_url}, router {fleet.router_url}, logs in {fleet.log_dir}")
            config = fleet.config  # as started: its Redis may have moved off another fleet's own
            say(f"    Redis keys {config.redis_prefix}* at {config.resolved_redis_url()}")
            # The fleet is up: a stop signal ends the submit at once, and the watch (supervised_watch holds its own).
            with raise_on_signals():
                client = RunsClient(fleet.api_url)
                run = client.submit(spec)
                say(f"4/5 GRPO run {run.id}: {spec.schedule.steps} steps")
                return supervised_watch(fleet, client, run.id, RestartPolicy())
        finally:
            fleet.stop()
            if fleet.config.scratch_keys and not fleet.owns_redis:
                delete_keys(fleet.config.resolved_redis_url(), fleet.config.redis_prefix, say)


def supervised_watch(
    fleet: LocalFleet, client: RunsClient, run_id: str, policy: RestartPolicy
) -> tuple[Run, dict[int, float], list[float]]:
    """`watch`, while the fleet's services are restarted as `rlfleet up` restarts them; StepFailed naming the
    service when one cannot be kept running, or when the watch is lost (the fleet stops with the demo, so the
    run cannot be followed again). Without it a dead trainer left the demo waiting, saying nothing."""
    done = threading.Event()
    ended: list[tuple[Run, dict[int, float], list[float]] | BaseException] = []

    def follow() -> None:
        try:
            ended.append(watch(client, run_id))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            ended.append(exc)
        finally:
            done.set()

    threading.Thread(target=follow, name="demo-watch", daemon=True).start()
    # A stop signal ends the wait at once, but raises only once the supervisor has returned: raised inside a
    # restart, between starting the service and recording it, it left that service running after the demo.
    with stop_on_signals(fleet, wake=done) as received:
        try:
            Supervisor(fleet, policy, say=lambda line: say(f"    {line}")).run(done)
        except GaveUp as exc:
            raise StepFailed(f"4/5 the fleet lost a service: {exc}") from None
        except StartInterrupted:  # the stop signal came while a service was being restarted
            pass
    if received:
        raise StopSignal(received[0])
    [result] = ended
    if isinstance(result, WatchEnded):
        raise StepFailed(f"4/5 lost run {run_id} at step {result.run.progress.step}: {result.why}") from None
    if isinstance(result, BaseException):
        raise result
    return result


def fleet_config(args: argparse.Namespace, out: Path) -> FleetConfig:
    """The demo's fleet: free ports, and a Redis prefix of its own unless --redis-prefix names one, so
    neither an orchestrator of `rlfleet up` on the same Redis nor another demo sees this demo's runs, and
    a run an interrupted demo left behind is never resumed by the next one."""
    return FleetConfig(
        model_path=out / "sft",
        engines=args.engines,
        state_dir=out / "fleet",
        ports=FleetPorts.free(args.engines),
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix or f"rlfleet-demo-{uuid.uuid4().hex[:8]}:",
        scratch_keys=args.redis_prefix is None,
    )


def is_previous_demo(out: Path) -> bool:
    """Holds the marker, or (written before there was one) a finished demo's summary and nothing but what a
    demo writes."""
    if (out / MARKER).exists():
        return True
    names = {entry.name for entry in out.iterdir()}
    return "summary.json" in names and names <= DEMO_OUTPUTS


def recreate(out: Path, overwrite: bool) -> None:
    """Empties `out` for a new demo; FileExistsError (saying what to do) for a directory whose fleet still
    runs, and for one that holds files and is not a previous demo's, unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; choose a directory")
    # A running fleet's state anywhere under `out` (a demo's own in out/fleet, an `rlfleet up --state-dir` there):
    # deleted, its fleet would run on where `rlfleet down` cannot find it.
    for record in sorted(out.rglob("fleet.json")) if out.is_dir() else ():
        if (fleet := running_fleet(record.parent)) is not None:
            raise FileExistsError(
                f"--out {out} holds the state of a fleet that {fleet}; stop it with "
                f"`rlfleet down --state-dir {record.parent}`, or choose another --out"
            )
    if out.exists() and any(out.iterdir()) and not is_previous_demo(out) and not overwrite:
        raise FileExistsError(
            f"--out {out} is not empty and is not a previous demo's directory (it has no {MARKER}); choose another "
            "--out, or add --overwrite to delete everything in it"
        )
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / MARKER).write_text(
        "written by `rlfleet demo` (or a benchmark): a later run with --out here deletes this directory\n"
    )


def watch(client: RunsClient, run_id: str) -> tuple[Run, dict[int, float], list[float]]:
    """Follows the run, printing its progress line when it changes; returns the run as it ended, the mean
    reward per step and the logprob diffs seen."""
    rewards: dict[int, float] = {}
    diffs: list[float] = []
    last = client.get(run_id)
    shown = ""
    for run in client.follow(run_id, on_lost=lambda note: say(f"    {note}")):
        last = run
        if run.progress.groups_produced:
            rewards[int(run.progress.step)] = run.progress.mean_reward
        if "logprob_diff" in run.metrics:
            diffs.append(run.metrics["logprob_diff"])
        if (line := progress_line(run)) != shown:
            say("    " + line)
            shown = line
        if run.state in FINAL_STATES:
            break
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
