"""The loop a worker process runs: receive a chunk of items, score them in order in the main thread.

A chunk is one message, and its replies come back in as few messages as possible, so the hub's event
loop wakes about once per chunk rather than once per item. Two things still reach the hub per item:
- `Progress`, two numbers in shared memory (which item runs, since when), read by the hub only when
  an item's time limit may have passed, so it knows which item to blame and when its limit ends;
- the replies so far, sent whenever `FLUSH_SECONDS` have passed since the last send, so that when a
  worker is killed mid-chunk, only the items it finished in that last moment must be scored again.
Replies carry only plain floats and strings, so whatever a function builds (sympy trees, say) never
crosses the pipe. The loop ends when the parent closes its end of the pipe; a worker that hangs is
the parent's to kill.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rlfleet.logs import init_logging
from rlfleet_reward.reward_function import RewardInput, Scored, ScoreFn
from rlfleet_reward.sandbox_memory import WorkerMemory, install
from rlfleet_reward.time_limit import TimeLimitExceeded

_PR_SET_PDEATHSIG = 1
# The first message of every worker: it started and can unpickle the functions it was given.
READY = "ready"
# Longest a worker holds finished replies before sending them (the most work a kill can lose).
FLUSH_SECONDS = 0.1


@dataclass(frozen=True)
class Chunk:
    """Items scored one after another by one function with one set of params."""

    function: str
    params: Mapping[str, Any]
    samples: Sequence[RewardInput]


@dataclass(frozen=True)
class Reply:
    """`error` is empty on success; otherwise it says why and `score`/`parts` are meaningless.

    `timed_out`: the error is the function's own time limit running out (`TimeLimitExceeded`), not a failure.
    `seconds` is how long the function ran.
    """

    score: float = 0.0
    parts: Mapping[str, float] | None = None
    error: str = ""
    seconds: float = 0.0
    timed_out: bool = False


class Progress:
    """Which item of its chunk a worker runs and since when (`time.monotonic()`, a system-wide clock).

    Two doubles in shared memory (a `RawArray("d", 2)`), written by the worker without a message. The
    worker writes the start time, then the index; a reader reads index, start, index again, so a start
    it accepts is never earlier than the item's real start: a torn read can only make it lenient.
    """

    def __init__(self, shared: Any) -> None:
        self._shared = shared

    def clear(self) -> None:
        """No item started yet: the hub clears it before sending a chunk."""
        self._shared[0] = -1.0

    def start(self, index: int) -> None:
        self._shared[1] = time.monotonic()
        self._shared[0] = float(index)

    def running(self) -> tuple[int, float] | None:
        """(index, started) of the item running, or None before the first or while it changes."""
        index = self._shared[0]
        started = self._shared[1]
        if index < 0 or index != self._shared[0]:
            return None
        return int(index), started


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


def timed_out_reply(exc: TimeLimitExceeded) -> Reply:
    return Reply(error=str(exc)[:1000] or "ran past its own time limit", timed_out=True)


def run_call(fn: ScoreFn, sample: RewardInput, params: Mapping[str, Any]) -> Reply:
    started = time.monotonic()
    try:
        reply = checked_reply(fn(sample, params))
    except Exception as exc:  # noqa: BLE001 - a function's failure is the item's ERROR, not the worker's
        reply = failure_reply(exc)
    except TimeLimitExceeded as exc:  # its own limit: the item ran out of time, the worker is fine
        reply = timed_out_reply(exc)
    return Reply(reply.score, reply.parts, reply.error, time.monotonic() - started, reply.timed_out)


def run_chunk(conn: Connection, functions: Mapping[str, ScoreFn], chunk: Chunk, progress: Progress) -> None:
    """Scores the chunk's items in order; sends the replies (a list) every FLUSH_SECONDS and at the end."""
    fn = functions[chunk.function]
    replies: list[Reply] = []
    sent = time.monotonic()
    last = len(chunk.samples) - 1
    for index, sample in enumerate(chunk.samples):
        progress.start(index)
        replies.append(run_call(fn, sample, chunk.params))
        if index == last or time.monotonic() - sent >= FLUSH_SECONDS:
            conn.send(replies)
            replies = []
            sent = time.monotonic()


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this worker when its parent goes, so a hung worker never outlives the hub."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_main(
    conn: Connection,
    functions: Mapping[str, ScoreFn],
    progress: Progress,
    log_level: int,
    memory: WorkerMemory | None = None,
) -> None:
    _die_with_parent()
    if memory is not None:
        install(memory)  # this worker's share of the hub's memory, for the `code` sandbox
    # A process of the fork server, which configured no logging: what the functions log (a judge's text without a
    # verdict, at INFO) went nowhere below WARNING, and in Python's own format above.
    init_logging("reward", logging.getLevelName(log_level))
    # Ctrl-C reaches the whole process group; the hub, not each worker, decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The scorers' imports (sympy, parsers) are long-lived: move them out of the collector's view so
    # each collection scans only what scoring allocates.
    gc.freeze()
    conn.send(READY)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        run_chunk(conn, functions, chunk, progress)
