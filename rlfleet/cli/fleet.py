"""`rlfleet up` / `rlfleet down`: the whole fleet on this machine as child processes."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from rlfleet.local_fleet import FleetConfig, LocalFleet, stop_from_state

DEFAULT_STATE_DIR = Path(".rlfleet")


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
    up.add_argument("--redis-url", default=None, help="use this Redis instead of 127.0.0.1:6379 / a started one")
    up.set_defaults(func=run_up)
    down = areas.add_parser("down", help="stop the fleet started by `rlfleet up`")
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


def run_up(args: argparse.Namespace) -> int:
    model_path = args.model_path or default_model(args.state_dir)
    fleet = LocalFleet(
        FleetConfig(
            model_path=model_path,
            engines=args.engines,
            state_dir=args.state_dir,
            redis_url=args.redis_url,
            engine_backend=args.engine,
            trainer_ranks=args.trainer_ranks,
        )
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"starting the fleet (logs in {fleet.log_dir}) ...")
    with fleet:
        engines = ", ".join(fleet.engine_urls())
        print(f"fleet is up: Runs API {fleet.api_url}, router {fleet.router_url}, engines {engines}")
        print("submit with `rlfleet submit examples/runs/arith-grpo.yaml`; Ctrl-C or `rlfleet down` stops it")
        try:
            while not stop.wait(1.0):
                dead = [name for name, proc in fleet.processes.items() if not proc.alive()]
                if dead:
                    print(f"warning: {', '.join(dead)} exited; see {fleet.log_dir}")
                    stop.wait(30.0)
        except KeyboardInterrupt:
            pass
        print("stopping the fleet ...")
    return 0


def run_down(args: argparse.Namespace) -> int:
    if not stop_from_state(args.state_dir):
        print(f"no fleet recorded in {args.state_dir / 'fleet.json'}")
        return 1
    print("fleet stopped")
    return 0
