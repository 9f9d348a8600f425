"""`rlfleet up` restarts a service that exits, with backoff and a budget, and gives up on one that keeps
crashing (the fleet is then stopped). Real child processes stand in for the services."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlfleet.fleet_supervisor import GaveUp, RestartPolicy, Supervisor
from rlfleet.processes import ServiceProcess

LIVES = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHES = [sys.executable, "-c", "raise SystemExit(3)"]
FAST = RestartPolicy(max_restarts=2, window_s=60.0, first_backoff_s=0.05, max_backoff_s=0.1)


class Fleet:
    """Services as child processes; `restart` starts the service's command again, as LocalFleet does."""

    def __init__(self, log_dir: Path, commands: dict[str, list[str]]) -> None:
        self.log_dir = log_dir
        self.commands = commands
        self.processes: dict[str, ServiceProcess] = {}
        self.restarts: list[str] = []
        for name in commands:
            self._start(name)

    def restart(self, name: str) -> None:
        self.restarts.append(name)
        self.processes[name].stop(timeout=5)
        self._start(name)

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop(timeout=5)

    def _start(self, name: str) -> None:
        self.processes[name] = ServiceProcess(name, self.commands[name], self.log_dir / f"{name}.log")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(tmp_path, {"router": LIVES, "rollout": LIVES})
    yield running
    running.stop()


@contextmanager
def bounded(timeout: float) -> Iterator[threading.Event]:
    """An event that ends a supervisor's run, set on leaving or after `timeout` (so a failing test cannot hang)."""
    done = threading.Event()
    timer = threading.Timer(timeout, done.set)
    timer.daemon = True
    timer.start()
    try:
        yield done
    finally:
        timer.cancel()
        done.set()


def test_a_crashed_service_is_restarted_and_its_new_pid_is_what_the_fleet_holds(fleet: Fleet) -> None:
    said: list[str] = []
    with bounded(20) as done:
        thread = threading.Thread(target=Supervisor(fleet, FAST, said.append, poll_s=0.05).run, args=(done,))
        thread.start()
        old = fleet.processes["rollout"]
        old.kill()
        deadline = time.monotonic() + 15
        while fleet.restarts != ["rollout"] or not fleet.processes["rollout"].alive():
            assert time.monotonic() < deadline, f"not restarted: {said}"
            time.sleep(0.05)
    thread.join(timeout=5)
    assert fleet.processes["rollout"].pid != old.pid
    assert fleet.processes["router"].alive() and fleet.restarts == ["rollout"]
    assert said[0].startswith("rollout exited with code -9; restarting it in 0.05 s (restart 1 of at most 2")
    assert said[1] == f"rollout is running again (pid {fleet.processes['rollout'].pid})"


def test_a_service_that_keeps_crashing_makes_the_supervisor_give_up(tmp_path: Path) -> None:
    crashing = Fleet(tmp_path, {"router": LIVES, "trainer": CRASHES})
    said: list[str] = []
    try:
        with bounded(20) as done, pytest.raises(GaveUp, match=r"^trainer exited with code 3 after 2 restarts within"):
            Supervisor(crashing, FAST, said.append, poll_s=0.05).run(done)
    finally:
        crashing.stop()
    assert crashing.restarts == ["trainer", "trainer"]
    assert [line.split(";")[0] for line in said if "exited" in line] == ["trainer exited with code 3"] * 2


def test_backoff_doubles_up_to_its_bound() -> None:
    policy = RestartPolicy(first_backoff_s=1, max_backoff_s=5)
    assert [policy.backoff_s(n) for n in range(5)] == [1, 2, 4, 5, 5]
