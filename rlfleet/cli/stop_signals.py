"""What Ctrl-C, SIGTERM and SIGHUP do to `rlfleet up` and `rlfleet demo`: stop the work, and the fleet with it.

The fleet's services run in sessions of their own (so a terminal's Ctrl-C reaches only the command, which
stops them in order); a command that died of a signal would leave the whole fleet running. Two modes:
`raise_on_signals` ends whatever the command waits on (creating a model, the demo's SFT child, a submit) by
raising StopSignal there, and `stop_on_signals` only asks a starting or running fleet to stop (whose supervisor
may be restarting a service), because a raise between starting a child and recording it would leave that child
where `rlfleet down` cannot find it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from rlfleet.local_fleet import LocalFleet

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignal(BaseException):
    """A stop signal arrived: the command ends, stopping what it started, with status 128 + `signum`. A
    BaseException, as KeyboardInterrupt: libraries' `except Exception` (transformers' optional imports, ...)
    must not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name}: stopped")


@contextmanager
def _handling(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


@contextmanager
def raise_on_signals() -> Iterator[None]:
    """Each stop signal raises StopSignal wherever the main thread is: a blocking read or wait ends at once,
    and `subprocess.run` kills its child on the way out. A raise that lands where a library swallows it (in
    an import, which some catch everything around) is made good when the block ends: StopSignal then."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        raise StopSignal(signum)

    with _handling(on_signal):
        yield
        if received:
            raise StopSignal(received[0])


@contextmanager
def stop_on_signals(fleet: LocalFleet, wake: threading.Event | None = None) -> Iterator[list[int]]:
    """Stop signals ask `fleet` to stop (a start or restart in progress gives up at its next check, `up`'s
    supervisor returns) and set `wake` (ending a wait on it) instead of raising wherever the main thread happens
    to be. Yields the signals received, first first."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if received:
            # print() is not safe in a handler that may interrupt print(); a raw write is.
            os.write(2, b"still stopping the fleet (each service has a bounded time to stop before it is killed)\n")
        received.append(signum)
        fleet.request_stop()
        if wake is not None:
            wake.set()

    with _handling(on_signal):
        yield received
