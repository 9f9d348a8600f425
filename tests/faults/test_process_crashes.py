"""SIGKILL one process of the fleet in the middle of a run: the run completes and no group is lost
or trained twice. A killed engine stays dead (the router routes around it); every other service is
started again, as its supervisor (Kubernetes, compose, systemd) would."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from rlfleet.local_fleet import LocalFleet

# The engine, reward hub and orchestrator cases take about 10 s each and run in `make test`; the
# others (`faults`) in `make test-faults`.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OUTAGE_S = 2.0
"""How long a killed service stays down before it is started again: long enough for callers to fail."""


def kill_and_restart(fleet: LocalFleet, name: str) -> None:
    fleet.processes[name].kill()
    time.sleep(OUTAGE_S)
    fleet.restart(name)


def engines_in_routing(fleet: LocalFleet) -> int:
    return int(httpx.get(f"{fleet.router_url}/fleet", timeout=5).json()["healthy"])


def trainer_ranks(launcher_pid: int) -> list[int]:
    """Pids of the rank processes torchrun started (its children running rlfleet_trainer)."""
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # exited while listed
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher_pid and b"rlfleet_trainer" in cmdline:
            ranks.append(int(entry.name))
    return ranks


def test_engine_killed(fault_fleet: LocalFleet, runs) -> None:
    run, _ = runs.survive("engine SIGKILL", fault_fleet.processes["engine-0"].kill)
    assert engines_in_routing(fault_fleet) == 1, "the dead engine should be out of routing"
    assert run.progress.weight_version == run.spec.schedule.steps


def test_reward_hub_killed_and_restarted(fault_fleet: LocalFleet, runs) -> None:
    runs.survive("reward hub SIGKILL + restart", lambda: kill_and_restart(fault_fleet, "reward"))


@pytest.mark.faults
def test_router_killed_and_restarted(fault_fleet: LocalFleet, runs) -> None:
    run, _ = runs.survive("router SIGKILL + restart", lambda: kill_and_restart(fault_fleet, "router"))
    fleet_state = httpx.get(f"{fault_fleet.router_url}/fleet", timeout=5).json()
    # The new router learnt the fleet's weights from the trainer's next update, not from its predecessor.
    assert fleet_state["weight_version"] == str(run.spec.schedule.steps), fleet_state


def test_orchestrator_killed_and_restarted(fault_fleet: LocalFleet, runs) -> None:
    runs.survive("orchestrator SIGKILL + restart (run resumes)", lambda: kill_and_restart(fault_fleet, "rollout"))


@pytest.mark.faults
def test_trainer_rank_killed(fault_fleet: LocalFleet, runs) -> None:
    launcher = fault_fleet.processes["trainer"]

    def kill_rank() -> None:
        ranks = trainer_ranks(launcher.pid)
        assert len(ranks) == 1, f"expected one trainer rank under torchrun {launcher.pid}, found {ranks}"
        os.kill(ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while launcher.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not launcher.alive(), "torchrun kept running after its only rank died"
        fault_fleet.restart("trainer")

    runs.survive("trainer rank SIGKILL + trainer restart", kill_rank)
