"""`rlfleet up`: the whole fleet on this machine as child processes.

`up` runs in the foreground: it checks its flags, records itself in <state-dir>/fleet.json (before it creates
the model, so `rlfleet down` can stop it from then on), starts the fleet (recording each process as it
starts it), restarts a service that exits (fleet_supervisor.py), and stops everything on Ctrl-C, SIGTERM
(what `rlfleet down` sends), SIGHUP or a service it cannot keep running.
Exit status: 0 when stopped after the fleet was up, 130 / 143 / 129 when stopped while starting (SIGINT /
SIGTERM / SIGHUP), 1 when a service failed to start or kept crashing, or when a service outlived the stop (it says
which: fleet.json keeps them for `rlfleet down`), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from rlfleet.cli.arg_types import MAX_ENGINES, engine_count, positive_float, positive_int, redis_prefix
from rlfleet.cli.steps import write_tiny_model
from rlfleet.cli.stop_signals import StopSignal, raise_on_signals, stop_on_signals
from rlfleet.errors import Conflict, Unavailable
from rlfleet.fleet_supervisor import GaveUp, RestartPolicy, Supervisor
from rlfleet.local_fleet import (
    FleetConfig,
    FleetPorts,
    LocalFleet,
    check_ports_free,
    describe_redis_error,
    record_starting,
    redis_error,
    remove_own_record,
)
from rlfleet.processes import ServiceStartError, StartInterrupted, process_runs
from rlfleet.redis_claim import refuse_if_held
from rlfleet.runs_client import load_spec_file

DEFAULT_STATE_DIR = Path(".rlfleet")
REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SPEC = REPO / "examples" / "runs" / "arith-grpo.yaml"


def register(areas: argparse._SubParsersAction) -> None:
    up = areas.add_parser(
        "up", help="start Redis (if none answers), engines, router, reward hub, trainer and orchestrator"
    )
    up.add_argument(
        "--model-path",
        type=Path,
        default=None,
        help="model the engines serve (default: <state-dir>/models/tiny, created when missing)",
    )
    up.add_argument(
        "--engines", type=engine_count, default=2, help=f"engines to start (default 2, at most {MAX_ENGINES})"
    )
    up.add_argument(
        "--engine",
        choices=["transformers", "sglang"],
        default="transformers",
        help="engine backend: transformers (CPU, default) or sglang (the real SGLang server, needs a GPU "
        "and `pip install 'rlfleet-engine[sglang]'`)",
    )
    up.add_argument(
        "--trainer-ranks",
        type=positive_int,
        default=1,
        help="torchrun ranks the trainer shards the policy over with FSDP2 (default 1)",
    )
    up.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="logs, weights and fleet.json")
    up.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=FleetConfig.startup_timeout_s,
        help="seconds each service has to become healthy (default 180; more for a large model to load)",
    )
    ports = up.add_mutually_exclusive_group()
    ports.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="listen on this port and the ones after it: Runs API, reward hub, trainer HTTP, orchestrator gRPC, "
        "trainer gRPC, reward hub gRPC, router, engines (default: the fixed ports of the README, Runs API 8000)",
    )
    ports.add_argument(
        "--free-ports", action="store_true", help="listen on ports that are free now (see fleet.json for them)"
    )
    up.add_argument("--redis-url", default=None, help="use this Redis instead of 127.0.0.1:6379 / a started one")
    up.add_argument(
        "--redis-prefix",
        type=redis_prefix,
        default="rlfleet:",
        help="prefix of the fleet's Redis keys: fleets sharing a Redis need different ones",
    )
    up.set_defaults(func=run_up)


def default_model(state_dir: Path) -> Path:
    """The tiny model under the state dir, created on first use: written beside it and moved into place, so
    an interrupted creation never leaves a model without its weights for the next `up` to serve."""
    path = state_dir / "models" / "tiny"
    if not (path / "config.json").exists():
        print(f"creating the tiny model in {path}", flush=True)
        for left in path.parent.glob(f".{path.name}.*"):  # of a creation whose `up` was killed
            pid = left.name.rsplit(".", 1)[1]
            if pid.isdigit() and not process_runs(int(pid)):
                shutil.rmtree(left, ignore_errors=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            # Quiet: what it would print names `partial`, a path gone once the model is in place.
            write_tiny_model("creating the tiny model", partial, quiet=True)
            shutil.rmtree(path, ignore_errors=True)  # a directory without config.json holds no model
            partial.rename(path)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        print(f"created the tiny model in {path}", flush=True)
    return path


def fleet_ports(args: argparse.Namespace) -> FleetPorts:
    if args.free_ports:
        return FleetPorts.free(args.engines)
    if args.base_port is not None:
        return FleetPorts.from_base(args.base_port, args.engines)
    return FleetPorts()


def check_model_path(path: Path | None) -> None:
    """ValueError naming --model-path when it holds no Hugging Face model (None: the default model, made later)."""
    if path is not None and not (path / "config.json").is_file():
        raise ValueError(f"--model-path {path}: no Hugging Face model there (config.json missing)")


def check_redis_url(url: str | None) -> None:
    """ValueError naming --redis-url when it is malformed, or the Redis there does not answer or answers
    with an error (a database index it lacks, a wrong password)."""
    if url is None:
        return
    try:
        error = redis_error(url)
    except ValueError as exc:  # not a Redis URL at all
        raise ValueError(f"--redis-url {url}: {exc}") from exc
    if error is not None:
        raise ValueError(f"--redis-url: {describe_redis_error(url, error)}")


def run_up(args: argparse.Namespace) -> int:
    ports = fleet_ports(args)  # bad flags are refused before anything is written or started
    named_ports = ports.named(args.engines)
    check_model_path(args.model_path)
    check_redis_url(args.redis_url)
    try:
        record_starting(args.state_dir)  # from here on `rlfleet down` stops this process
    except ServiceStartError as exc:
        print(f"rlfleet: error: the fleet did not start: {exc}", file=sys.stderr)
        return 1
    try:  # before the model is made: a busy port or a held key prefix is known at once (the fleet checks again
        # as it starts, and claims the prefix then)
        check_ports_free(FleetConfig.host, named_ports)
        if args.redis_url:
            refuse_if_held(args.redis_url, args.redis_prefix)
    except (ServiceStartError, Conflict, Unavailable) as exc:
        remove_own_record(args.state_dir)
        print(f"rlfleet: error: the fleet did not start: {exc}", file=sys.stderr)
        return 1
    try:
        with raise_on_signals():  # nothing started yet: a stop signal ends the model's creation at once
            fleet = LocalFleet(
                FleetConfig(
                    model_path=args.model_path or default_model(args.state_dir),
                    engines=args.engines,
                    state_dir=args.state_dir,
                    ports=ports,
                    redis_url=args.redis_url,
                    redis_prefix=args.redis_prefix,
                    engine_backend=args.engine,
                    trainer_ranks=args.trainer_ranks,
                    startup_timeout_s=args.startup_timeout,
                )
            )
    except StopSignal as stop:
        remove_own_record(args.state_dir)
        name = signal.Signals(stop.signum).name
        print(f"{name} while the fleet was starting: stopped before any service started", file=sys.stderr)
        return 128 + stop.signum
    except BaseException:
        remove_own_record(args.state_dir)
        raise
    return run_fleet(fleet)  # the fleet takes the record over (and removes it when it stops)


def run_fleet(fleet: LocalFleet) -> int:
    """Starts the fleet, keeps it running until a stop signal or a service it cannot keep running, and stops
    it; the exit status of `up`."""
    with stop_on_signals(fleet) as received:
        print(f"starting the fleet (logs in {fleet.log_dir}; Ctrl-C or `rlfleet down` stops it) ...", flush=True)
        try:
            fleet.start()
        except StartInterrupted:
            name = signal.Signals(received[0]).name if received else "a stop request"
            if fleet.left_running:
                what = left_running(fleet, fleet.left_running)
                print(f"rlfleet: error: {name} while the fleet was starting: {what}", file=sys.stderr)
                return 1
            print(f"{name} while the fleet was starting: stopped every service it had started", file=sys.stderr)
            return 128 + (received[0] if received else signal.SIGTERM)
        except ServiceStartError as exc:
            print(f"rlfleet: error: the fleet did not start: {exc}", file=sys.stderr)
            if fleet.left_running:
                print(f"rlfleet: error: {left_running(fleet, fleet.left_running)}", file=sys.stderr)
            return 1
        try:
            code = supervise(fleet)
        finally:
            left = fleet.stop()
        if left:
            print(f"rlfleet: error: {left_running(fleet, left)}", file=sys.stderr, flush=True)
            return 1
        print("fleet stopped", flush=True)
        return code


def supervise(fleet: LocalFleet) -> int:
    """Keeps the started fleet running until a stop signal (0) or a service it cannot keep running (1)."""
    try:
        print(up_message(fleet), flush=True)
        Supervisor(fleet, RestartPolicy(), say=lambda line: print(line, flush=True)).run(fleet.stopping)
    except GaveUp as exc:
        print(f"rlfleet: error: {exc}\nstopping the fleet", file=sys.stderr, flush=True)
        return 1
    except StartInterrupted:  # stopped while a crashed service was being restarted
        pass
    print("stopping the fleet ...", flush=True)
    return 0


def left_running(fleet: LocalFleet, left: list[str]) -> str:
    """What a stop that left services running says: fleet.json keeps them for `rlfleet down`, which tries again."""
    return (
        f"{', '.join(left)} still running after the fleet's stop ({fleet.state_path} names them): "
        f"stop them with `rlfleet down --state-dir {fleet.config.state_dir}`"
    )


def up_message(fleet: LocalFleet) -> str:
    """What is up, and a first run that works on it."""
    engines = ", ".join(fleet.engine_urls())
    state_dir = fleet.config.state_dir
    where = "" if Path(state_dir) == DEFAULT_STATE_DIR else f" --state-dir {state_dir}"
    example = _shown(EXAMPLE_SPEC)
    lines = [
        f"fleet is up: Runs API {fleet.api_url} (gRPC {fleet.grpc_address}), router {fleet.router_url}, "
        f"engines {engines}"
    ]
    if not EXAMPLE_SPEC.is_file():  # installed without the repository's examples
        return "\n".join([*lines, f"submit a run: rlfleet submit SPEC.yaml{where} --watch"])
    model_path = load_spec_file(EXAMPLE_SPEC).model.path
    # The orchestrator and trainer run in this directory: a relative model.path is resolved against it.
    if (Path(model_path) / "config.json").is_file():
        lines.append(f"submit a run: rlfleet submit {example}{where} --watch")
    else:
        relative = "" if Path(model_path).is_absolute() else ", relative to this directory"
        lines.append(
            f"{example} starts from the demo's warm-started model ({model_path}{relative}), "
            "which is not there yet: run `rlfleet demo` (or `make demo`) here once, or train the model this fleet "
            f"serves: rlfleet submit {example}{where} --model-path {Path(fleet.config.model_path).resolve()} --watch"
        )
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies under it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
