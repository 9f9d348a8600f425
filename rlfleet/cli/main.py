"""`rlfleet`: one entry point with a subcommand per task (`rlfleet model init`, `rlfleet submit`, ...)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rlfleet.cli import data, demo, fleet, model, runs
from rlfleet.cli.defaults_help import CommandParser
from rlfleet.errors import RlfleetError
from rlfleet.logs import init_logging


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="rlfleet", description="rlfleet: RL post-training of LLMs as a fleet.")
    areas = parser.add_subparsers(dest="area", required=True, metavar="COMMAND")
    model.register(areas)
    data.register(areas)
    fleet.register(areas)
    runs.register(areas)
    demo.register(areas)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_logging("cli")
    try:
        return int(args.func(args) or 0)
    except (RlfleetError, ValueError, FileExistsError, FileNotFoundError) as exc:
        logging.getLogger("rlfleet").debug("command failed", exc_info=True)
        print(f"rlfleet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C ends a watch (the run goes on); `up` handles it itself, to stop the fleet
        print("\ninterrupted", file=sys.stderr)
        return 130
