"""`rlfleet up` / `rlfleet down`: the whole fleet on this machine as child processes.

`up` runs in the foreground: it starts the fleet (recording it in <state-dir>/fleet.json from the first
process on), restarts a service that exits (fleet_supervisor.py), and stops everything on Ctrl-C, SIGTERM
(what `rlfleet down` sends, even while the fleet is starting) or a service it cannot keep running.
Exit status: 0 when stopped after the fleet was up, 130 / 143 when interrupted while starting (SIGINT /
SIGTERM), 1 when a service failed to start or kept crashing.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from rlfleet.fleet_supervisor import GaveUp, RestartPolicy, Supervisor
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet, read_state, stop_from_state
from rlfleet.processes import ServiceStartError, StartInterrupted
from rlfleet.runs_client import load_spec_file

DEFAULT_STATE_DIR = Path(".rlfleet")
REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SPEC = REPO / "examples" / "runs" / "arith-grpo.yaml"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
    up.add_argument("--engines", type=int, default=2, help="engines to start (default 2)")
    up.add_argument(
        "--engine",
        choices=["transformers", "sglang"],
        default="transformers",
        help="engine backend: transformers (CPU, default) or sglang (the real SGLang server, needs a GPU "
        "and `pip install 'rlfleet-engine[sglang]'`)",
    )
    up.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        help="torchrun ranks the trainer shards the policy over with FSDP2 (default 1)",
    )
    up.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="logs, weights and fleet.json")
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
        default="rlfleet:",
        help="prefix of the fleet's Redis keys: fleets sharing a Redis need different ones",
    )
    up.set_defaults(func=run_up)
    down = areas.add_parser("down", help="stop the fleet started by `rlfleet up` (also while it is starting)")
    down.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="the state directory `rlfleet up` used")
    down.set_defaults(func=run_down)


def default_model(state_dir: Path) -> Path:
    """The tiny model under the state dir, created on first use."""
    path = state_dir / "models" / "tiny"
    if not (path / "config.json").exists():
        from rlfleet.tiny_model import create_tiny_model

        print(f"creating the tiny model in {path}")
        create_tiny_model(path)
    return path


def fleet_ports(args: argparse.Namespace) -> FleetPorts:
    if args.free_ports:
        return FleetPorts.free(args.engines)
    if args.base_port is not None:
        return FleetPorts.from_base(args.base_port, args.engines)
    return FleetPorts()


@contextmanager
def stop_on_signals(fleet: LocalFleet) -> Iterator[list[int]]:
    """Ctrl-C, SIGTERM and SIGHUP ask the fleet to stop (a start in progress gives up at its next check)
    instead of raising wherever the main thread happens to be, which could leave a child started but
    unrecorded. Yields the signals received, first first."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if received:
            # print() is not safe in a handler that may interrupt print(); a raw write is.
            os.write(2, b"still stopping the fleet (each service gets 20 s before it is killed)\n")
        received.append(signum)
        fleet.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_up(args: argparse.Namespace) -> int:
    ports = fleet_ports(args)  # a bad --base-port is refused before the model is written
    model_path = args.model_path or default_model(args.state_dir)
    fleet = LocalFleet(
        FleetConfig(
            model_path=model_path,
            engines=args.engines,
            state_dir=args.state_dir,
            ports=ports,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            engine_backend=args.engine,
            trainer_ranks=args.trainer_ranks,
        )
    )
    with stop_on_signals(fleet) as received:
        print(f"starting the fleet (logs in {fleet.log_dir}; Ctrl-C or `rlfleet down` stops it) ...", flush=True)
        try:
            fleet.start()
        except StartInterrupted:
            name = signal.Signals(received[0]).name if received else "a stop request"
            print(f"{name} while the fleet was starting: stopped every service it had started", file=sys.stderr)
            return 128 + (received[0] if received else signal.SIGTERM)
        except ServiceStartError as exc:
            print(f"rlfleet: error: the fleet did not start: {exc}", file=sys.stderr)
            return 1
        try:
            print(up_message(fleet), flush=True)
            Supervisor(fleet, RestartPolicy(), say=lambda line: print(line, flush=True)).run(fleet.stopping)
            print("stopping the fleet ...", flush=True)
            return 0
        except GaveUp as exc:
            print(f"rlfleet: error: {exc}\nstopping the fleet", file=sys.stderr, flush=True)
            return 1
        except StartInterrupted:  # stopped while a crashed service was being restarted
            print("stopping the fleet ...", flush=True)
            return 0
        finally:
            fleet.stop()
            print("fleet stopped", flush=True)


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


def run_down(args: argparse.Namespace) -> int:
    state = read_state(args.state_dir)
    if state is None:
        print(f"no fleet recorded in {args.state_dir / 'fleet.json'}", file=sys.stderr)
        return 1
    print(f"stopping the fleet of `rlfleet up` (pid {state['pid']}, {state.get('state', 'up')}) ...", flush=True)
    stop_from_state(args.state_dir)
    print("fleet stopped")
    return 0
