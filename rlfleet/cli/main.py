"""`rlfleet`: one entry point with a subcommand per task (`rlfleet model init`, `rlfleet submit`, ...).

Errors end a command with one line on stderr, never a traceback: status 2 for an error, 3 for a watch that
could not be kept up while its run went on (cli/runs.py), 128 + N for signal N (Ctrl-C: 130), 141 when the
reader of the output went away (`rlfleet data arithmetic | head -1`), as for a process SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from rlfleet.cli import data, demo, down, fleet, model, runs, show
from rlfleet.cli.defaults_help import CommandParser
from rlfleet.cli.runs import WATCH_ENDED_EXIT, WatchInterrupted
from rlfleet.cli.stop_signals import StopSignal
from rlfleet.errors import RlfleetError
from rlfleet.logs import init_logging
from rlfleet.runs_client import WatchEnded


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="rlfleet", description="rlfleet: RL post-training of LLMs as a fleet.")
    areas = parser.add_subparsers(dest="area", required=True, metavar="COMMAND")
    model.register(areas)
    data.register(areas)
    fleet.register(areas)
    down.register(areas)
    runs.register(areas)
    show.register(areas)
    demo.register(areas)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_logging("cli")
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except WatchEnded as exc:
        exc.follow_again += runs.address_flags(args)
        print(f"rlfleet: {exc}", file=sys.stderr)
        return WATCH_ENDED_EXIT
    except (RlfleetError, ValueError, FileExistsError, FileNotFoundError, PermissionError, NotADirectoryError) as exc:
        logging.getLogger("rlfleet").debug("command failed", exc_info=True)
        print(f"rlfleet: error: {exc}", file=sys.stderr)
        return 2
    except StopSignal as stop:  # `up` and `demo` have stopped what they started
        print(f"\n{stop}", file=sys.stderr)
        return 128 + stop.signum
    except WatchInterrupted as stop:  # Ctrl-C ends the watch, not the run
        again = f"{stop.run_id}{runs.address_flags(args)}"
        print(
            f"\nstopped watching {stop.run_id}; the run goes on: `rlfleet watch {again}` follows it again, "
            f"`rlfleet cancel {again}` cancels it",
            file=sys.stderr,
        )
        return 130
    except KeyboardInterrupt:  # `up` and `demo` handle Ctrl-C themselves
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whatever is still buffered for stdout cannot be written: point it at /dev/null, so the interpreter's
        # flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:  # a disk full, an I/O error: of the output (`> /dev/full`) or of a file written
        print(f"rlfleet: error: {exc}", file=sys.stderr)
        try:
            sys.stdout.flush()
        except OSError:  # the output itself failed: what is still buffered would fail again at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 2
