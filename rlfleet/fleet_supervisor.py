"""What `rlfleet up` does while the fleet runs: a service that exits is started again, within a budget.

Every service of rlfleet resumes from what it keeps in Redis and on disk (the orchestrator its runs, the
trainer its last checkpoint, the router the fleet's weight version, an engine the weights the router has
it load), so restarting a crashed one is what an operator would do by hand, minus the minutes. A service
that keeps crashing is a fault a restart does not fix: after `max_restarts` within `window_s` the
supervisor gives up, and `rlfleet up` stops the whole fleet and says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rlfleet.processes import ServiceProcess, ServiceStartError

logger = logging.getLogger(__name__)


class SupervisedFleet(Protocol):
    """What the supervisor needs of a fleet (LocalFleet has it)."""

    @property
    def processes(self) -> Mapping[str, ServiceProcess]: ...

    def restart(self, name: str) -> None: ...


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    """Restarts of one service within `window_s`; one more crash in that window stops the fleet."""
    window_s: float = 600.0
    first_backoff_s: float = 1.0
    """Wait before the first restart of a service in the window; doubled for each further one."""
    max_backoff_s: float = 30.0

    def backoff_s(self, restarts_in_window: int) -> float:
        return min(self.first_backoff_s * 2**restarts_in_window, self.max_backoff_s)


class GaveUp(Exception):
    """A service kept crashing, or could not be started again; the message says which and why."""


class Supervisor:
    def __init__(
        self, fleet: SupervisedFleet, policy: RestartPolicy, say: Callable[[str], None], poll_s: float = 1.0
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.say = say
        self.poll_s = poll_s
        self._restarts: dict[str, list[float]] = {}
        """Monotonic times of each service's restarts within the window."""

    def run(self, stop: threading.Event) -> None:
        """Until `stop` is set: restarts every service that exited. GaveUp when one cannot be kept running."""
        while not stop.wait(self.poll_s):
            for name, process in list(self.fleet.processes.items()):
                if not process.alive() and not stop.is_set():
                    self._restart(name, process, stop)

    def _restart(self, name: str, process: ServiceProcess, stop: threading.Event) -> None:
        now = time.monotonic()
        recent = [t for t in self._restarts.get(name, []) if now - t < self.policy.window_s]
        code = process.proc.returncode
        if len(recent) >= self.policy.max_restarts:
            raise GaveUp(
                f"{name} exited with code {code} after {len(recent)} restarts within {self.policy.window_s:.0f} s; "
                f"last lines of {process.log_path}:\n{process.log_tail()}"
            )
        backoff = self.policy.backoff_s(len(recent))
        self.say(
            f"{name} exited with code {code}; restarting it in {backoff:g} s "
            f"(restart {len(recent) + 1} of at most {self.policy.max_restarts} within {self.policy.window_s:.0f} s; "
            f"log {process.log_path})"
        )
        if stop.wait(backoff):
            return
        self._restarts[name] = [*recent, time.monotonic()]
        try:
            self.fleet.restart(name)
        except ServiceStartError as exc:
            raise GaveUp(f"restarting {name} failed: {exc}") from exc
        self.say(f"{name} is running again (pid {self.fleet.processes[name].pid})")
