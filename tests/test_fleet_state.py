"""fleet.json outlives its processes when `rlfleet up` is killed or the machine restarts, and pids are
reused: `rlfleet down` signals a recorded pid only while it still names the recorded process, and `up`
takes a state directory over from a fleet that is gone."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet, stop_from_state
from rlfleet.process_identity import start_time
from rlfleet.processes import ServiceProcess, ServiceStartError


@pytest.fixture
def sleepers(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    """Two processes standing in for a fleet's `rlfleet up` and one of its services."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [ServiceProcess(f"sleeper-{i}", argv, tmp_path / f"{i}.log") for i in range(2)]
    yield procs
    for proc in procs:
        proc.stop(timeout=5)


def record(state_dir: Path, owner: ServiceProcess, service: ServiceProcess, shift_s: float = 0.0) -> None:
    """A fleet.json naming `owner` as `rlfleet up` and `service` as its engine; `shift_s` moves the recorded
    start times, as if other processes had had these pids."""
    started = {"up": start_time(owner.pid), "engine-0": start_time(service.pid)}
    state = {
        "pid": owner.pid,
        "state": "up",
        "processes": {"engine-0": service.pid},
        "started": {name: t + shift_s for name, t in started.items() if t is not None},
    }
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "fleet.json").write_text(json.dumps(state))


def test_down_leaves_alone_processes_that_only_have_the_recorded_pids(
    tmp_path: Path, sleepers: list[ServiceProcess]
) -> None:
    owner, service = sleepers
    record(tmp_path, owner, service, shift_s=-3600)
    assert stop_from_state(tmp_path, timeout_s=1)
    assert owner.alive() and service.alive()
    assert not (tmp_path / "fleet.json").exists()


def test_down_stops_the_recorded_processes(tmp_path: Path, sleepers: list[ServiceProcess]) -> None:
    owner, service = sleepers
    record(tmp_path, owner, service)
    assert stop_from_state(tmp_path, timeout_s=1)
    owner.proc.wait(timeout=5)
    service.proc.wait(timeout=5)
    assert not (tmp_path / "fleet.json").exists()


def test_up_refuses_a_state_dir_whose_fleet_runs_and_takes_over_a_stale_one(
    tmp_path: Path, sleepers: list[ServiceProcess]
) -> None:
    owner, service = sleepers
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = FleetConfig(
        model_path=model, state_dir=tmp_path / "state", ports=FleetPorts.free(2), redis_url="redis://127.0.0.1:1/0"
    )
    fleet = LocalFleet(config)
    record(tmp_path / "state", owner, service)
    with pytest.raises(ServiceStartError, match=rf"a fleet started from .* is up \(`rlfleet up`, pid {owner.pid}\)"):
        fleet.start()
    assert (tmp_path / "state" / "fleet.json").exists(), "the running fleet's record was kept"
    record(tmp_path / "state", owner, service, shift_s=-3600)
    # Past the check, this fleet stops at its first step (no Redis there) and removes what it recorded.
    with pytest.raises(ServiceStartError, match="does not answer"):
        fleet.start()
    assert not (tmp_path / "state" / "fleet.json").exists()


def test_stop_reports_a_service_that_had_exited_and_not_the_exit_codes_of_those_it_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun exits 1 when SIGTERM stops it: `stopped trainer (exit code 1)` read like a failure."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fleet = LocalFleet(FleetConfig(model_path=model, state_dir=tmp_path / "state"))
    exits_one_on_sigterm = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(1)); time.sleep(60)"
    )
    fleet.processes["trainer"] = ServiceProcess(
        "trainer", [sys.executable, "-c", exits_one_on_sigterm], tmp_path / "t.log"
    )
    crashed = fleet.processes["reward"] = ServiceProcess(
        "reward", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "r.log"
    )
    crashed.proc.wait(timeout=30)
    time.sleep(0.5)  # the trainer's handler is installed
    with caplog.at_level("INFO", logger="rlfleet.local_fleet"):
        fleet.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert "reward had already exited (exit code 3)" in messages
    assert "stopped trainer" in messages and not any("exit code 1" in m for m in messages)
