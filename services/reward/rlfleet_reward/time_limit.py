"""A reward function's own time limit on one item, and what its expiry means.

The hub kills a worker whose item runs past the item's limit: a sure stop, even for C code that ignores
signals, but one that costs a fresh worker. A function whose work may run long in Python (a library's parsing
and comparison) bounds that work with a shorter limit of its own (`time_limit`), which interrupts it at the
next bytecode and leaves the worker serving. Either way the item ran out of time; what it then scores is the
function's `RewardFunction.timeout_score` to say.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class TimeLimitExceeded(BaseException):  # noqa: N818 - named for what happened, as TimeoutError is
    """A reward function ran out of its own time limit on an item: raised by `time_limit`, or by the function.

    A BaseException, as KeyboardInterrupt is, so that a library's `except Exception` around the interrupted work
    does not take it for a failure of its own and carry on (math-verify reads such a failure as no answer).
    """


@contextmanager
def time_limit(seconds: float, what: str = "the reward function") -> Iterator[None]:
    """Raises TimeLimitExceeded in the body once `seconds` have passed (wall clock): SIGALRM, so in a process's
    main thread only, as a worker runs its functions. Work inside C code is interrupted once it returns to Python.
    Nesting is not supported: the body must not set SIGALRM itself (math-verify does unless told not to)."""
    if seconds <= 0:
        raise TimeLimitExceeded(f"{what} had no time left")

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeLimitExceeded(f"{what} ran past its {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
