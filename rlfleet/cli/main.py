"""`rlfleet`: one entry point with a subcommand per task (`rlfleet model init`, `rlfleet submit`, ...)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from rlfleet.cli import data, demo, fleet, model, runs
from rlfleet.errors import RlfleetError
from rlfleet.logs import init_logging


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends with the option's default, unless the help already speaks of it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.option_strings or unset or "default" in text:
            return action.help
        shown = str(action.default).replace("%", "%%")  # the help is a %-format string
        return f"{text} (default {shown})" if text else f"(default {shown})"


class CommandParser(argparse.ArgumentParser):
    """Every parser of the `rlfleet` command, subcommands' included, shows defaults in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


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
