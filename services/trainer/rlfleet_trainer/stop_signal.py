"""SIGTERM from the first moment of `serve`: while the trainer starts it ends the process at once, with the status of
a stop; once the trainer serves it stops the servers, and then the runs, within their bounds.

Python's default SIGTERM killed a trainer that was importing torch (status -15, not a stop's 0), and the handler that
then swallowed uvicorn's re-raised signal also swallowed one that came before uvicorn took SIGTERM over: that trainer
kept serving.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType


class StoppedStarting(BaseException):
    """Raised where the main thread is by a SIGTERM that came while the trainer started (imports, the ranks joining,
    the core being made): it serves nothing and has written nothing yet. A BaseException, as KeyboardInterrupt, so
    no `except Exception` on the way swallows it."""


class StopSignal:
    def __init__(self) -> None:
        """Takes SIGTERM over from now on."""
        self._on_stop: Callable[[], None] | None = None
        signal.signal(signal.SIGTERM, self._handle)

    def serving(self, on_stop: Callable[[], None]) -> None:
        """Startup is over: a SIGTERM from now on calls `on_stop` (in the main thread) instead of ending the process.
        uvicorn takes SIGTERM over while it serves and re-raises it once it has stopped: it lands here then."""
        self._on_stop = on_stop

    def ignore(self) -> None:
        """SIGTERM is ignored from now on (a follower rank: rank 0 alone decides when the ranks stop)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        if self._on_stop is None:
            raise StoppedStarting
        self._on_stop()
