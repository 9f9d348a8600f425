"""Long steps of `rlfleet up` and `rlfleet demo` run as child processes, each failure one line naming the step.

A child keeps a stop signal simple: it lands while this process waits for the child (StopSignal there, and
`subprocess.run` kills the child), never in the middle of importing torch or transformers, which turn an
exception raised there into errors of their own and leave modules half imported.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from rlfleet.errors import RlfleetError
from rlfleet.processes import command_line, killed_with_parent
from rlfleet.v1.runs_pb2 import RunSpec

MODEL_TIMEOUT_S = 600.0
"""Bound on writing the tiny model (seconds on an idle machine; importing torch is most of it)."""
SFT_TIMEOUT_S = 1800.0
"""Bound on the SFT warm start: its default 400 steps take minutes on two busy cores."""


class StepFailed(RlfleetError):
    """A step ran a command that failed; its output is already on the terminal."""


def run_step(name: str, argv: list[str], timeout_s: float, quiet: bool = False) -> None:
    """Runs one step's command (its output goes to the terminal; when `quiet`, only if it fails); StepFailed,
    one line naming the step, when it fails or outlasts `timeout_s`."""
    env = {**os.environ, "RLFLEET_LOG_FORMAT": "text"}
    try:
        subprocess.run(
            argv,
            check=True,
            timeout=timeout_s,
            env=env,
            capture_output=quiet,
            text=True,
            preexec_fn=killed_with_parent(),
        )
    except subprocess.CalledProcessError as exc:
        if quiet:
            sys.stderr.write(exc.stdout + exc.stderr)
        raise StepFailed(
            f"{name} failed: {shlex.join(argv)} exited with code {exc.returncode}; its output is above"
        ) from None
    except subprocess.TimeoutExpired:
        raise StepFailed(f"{name} failed: {shlex.join(argv)} did not finish within {timeout_s:g} s") from None


def write_tiny_model(name: str, out: Path, quiet: bool = False) -> None:
    """The tiny model and its tokenizer written into `out` by `rlfleet model init` in a child process (whose
    output is shown, when `quiet`, only if it fails)."""
    argv = [sys.executable, "-m", "rlfleet.cli", "model", "init", "--out", str(out)]
    run_step(name, argv, MODEL_TIMEOUT_S, quiet=quiet)


def warm_start(spec: RunSpec, out: Path, sft_steps: int, names: tuple[str, str], say: Callable[[str], None]) -> Path:
    """The tiny model in `out`/base, then its SFT warm start on `spec`'s arithmetic task (its digits, operators and
    seed) in `out`/sft, which it returns; `names` are the two steps' names, told to `say` as each starts."""
    say(names[0])
    write_tiny_model(names[0], out / "base")
    say(f"{names[1]} ({sft_steps} steps)")
    arith = spec.dataset.arithmetic
    sft = command_line(
        sys.executable,
        "-m",
        "rlfleet_trainer",
        "sft",
        model_path=out / "base",
        out=out / "sft",
        steps=sft_steps,
        digits=arith.digits or 2,
        ops=arith.ops or "+",
        seed=spec.trainer.seed,
    )
    run_step(names[1], sft, timeout_s=SFT_TIMEOUT_S)
    return out / "sft"
