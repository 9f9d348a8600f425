"""The loop a worker process runs: receive a job, call the reward function in the main thread, reply.

Replies carry only plain floats and strings, so whatever a function builds (sympy trees, say) never
crosses the pipe. The loop ends when the parent closes its end of the pipe; a worker that hangs is
the parent's to kill.
"""

from __future__ import annotations

import ctypes
import math
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rlfleet_reward.reward_function import RewardInput, Scored, ScoreFn

_PR_SET_PDEATHSIG = 1
# The first message of every worker: it started and can unpickle the functions it was given.
READY = "ready"


@dataclass(frozen=True)
class Job:
    function: str
    sample: RewardInput
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Reply:
    """`error` is empty on success; otherwise it says why and `score`/`parts` are meaningless."""

    score: float = 0.0
    parts: Mapping[str, float] | None = None
    error: str = ""


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} is a {type(value).__name__}; expected a float")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{what} is {result}; expected a finite number")
    return result


def checked_reply(value: object) -> Reply:
    """A function's return value as a Reply; raises when it is not a finite float or a Scored of them."""
    if isinstance(value, Scored):
        parts = {str(name): _finite(part, f"part {name!r}") for name, part in value.parts.items()}
        return Reply(score=_finite(value.score, "the score"), parts=parts)
    return Reply(score=_finite(value, "the returned value"))


def failure_reply(exc: Exception) -> Reply:
    return Reply(error=f"{type(exc).__name__}: {exc}"[:1000])


def run_job(functions: Mapping[str, ScoreFn], job: Job) -> Reply:
    try:
        return checked_reply(functions[job.function](job.sample, job.params))
    except Exception as exc:  # noqa: BLE001 - a function's failure is the item's ERROR, not the worker's
        return failure_reply(exc)


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this worker when its parent goes, so a hung worker never outlives the hub."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_main(conn: Connection, functions: Mapping[str, ScoreFn]) -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole process group; the hub, not each worker, decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(READY)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(run_job(functions, job))
