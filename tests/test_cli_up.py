"""`rlfleet up` while it is still starting: `rlfleet down` stops it (fleet.json records each process as it
starts), and Ctrl-C ends it cleanly (a message, no traceback, status 130). Both stop every child. Once up, it
says where the Runs API listens on both transports; a bad --base-port is refused before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.cli.fleet import EXAMPLE_SPEC, up_message
from rlfleet.cli.main import main
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet, router_policy

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def rlfleet(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlfleet.cli", *args]


@pytest.fixture
def starting_fleet(tmp_path: Path, small_model_dir: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """`rlfleet up` once it has recorded its first engine, and its state dir. Afterwards whatever it
    recorded is killed by pid, should the test have left anything."""
    state_dir = tmp_path / "state"
    up = subprocess.Popen(
        rlfleet("up", "--free-ports", "--engines", "1", "--model-path", str(small_model_dir))
        + [
            "--state-dir",
            str(state_dir),
            "--redis-url",
            REDIS_URL,
            "--redis-prefix",
            f"rlfleet-test:{uuid.uuid4().hex}:",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    recorded: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 60
        while "engine-0" not in recorded:
            assert up.poll() is None, f"rlfleet up exited with {up.returncode}: {up.communicate()}"
            assert time.monotonic() < deadline, "rlfleet up recorded no engine within 60 s"
            time.sleep(0.05)
            try:
                recorded = json.loads((state_dir / "fleet.json").read_text())["processes"]
            except (FileNotFoundError, ValueError):
                continue
        yield up, state_dir
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(timeout=10)
        for pid in recorded.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def recorded_pids(state_dir: Path) -> list[int]:
    return list(json.loads((state_dir / "fleet.json").read_text())["processes"].values())


@pytest.mark.e2e
def test_down_stops_a_fleet_that_is_still_starting(starting_fleet: tuple[subprocess.Popen[str], Path]) -> None:
    up, state_dir = starting_fleet
    state = json.loads((state_dir / "fleet.json").read_text())
    assert state["state"] == "starting" and state["pid"] == up.pid
    pids = recorded_pids(state_dir)
    down = subprocess.run(rlfleet("down", "--state-dir", str(state_dir)), capture_output=True, text=True, timeout=90)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "starting" in down.stdout and "fleet stopped" in down.stdout
    out, err = up.communicate(timeout=60)
    assert up.returncode == 128 + signal.SIGTERM, out + err
    assert "SIGTERM while the fleet was starting" in err and "fleet is up" not in out
    assert not (state_dir / "fleet.json").exists()
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.e2e
def test_ctrl_c_while_starting_stops_the_fleet_with_status_130(
    starting_fleet: tuple[subprocess.Popen[str], Path],
) -> None:
    up, state_dir = starting_fleet
    pids = recorded_pids(state_dir)
    up.send_signal(signal.SIGINT)
    out, err = up.communicate(timeout=60)
    assert up.returncode == 130, out + err
    assert "SIGINT while the fleet was starting: stopped every service it had started" in err
    assert "Traceback" not in err
    assert not (state_dir / "fleet.json").exists()
    assert not [pid for pid in pids if alive(pid)]


def test_the_first_run_up_suggests_works_on_a_fresh_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    fleet = LocalFleet(FleetConfig(model_path=model, engines=1, state_dir=tmp_path / "state"))
    monkeypatch.chdir(tmp_path)  # where the services would run: no demo model here yet
    fresh = up_message(fleet)
    assert "run `rlfleet demo` (or `make demo`) here once" in fresh
    assert f"--state-dir {tmp_path / 'state'} --model-path {model} --watch" in fresh
    (tmp_path / ".rlfleet" / "demo" / "sft").mkdir(parents=True)
    (tmp_path / ".rlfleet" / "demo" / "sft" / "config.json").write_text("{}")
    assert up_message(fleet).splitlines()[1] == (
        f"submit a run: rlfleet submit {EXAMPLE_SPEC} --state-dir {tmp_path / 'state'} --watch"
    )


def test_up_names_the_runs_api_on_both_transports(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ports = FleetPorts.from_base(9400, engines=1)
    fleet = LocalFleet(FleetConfig(model_path=model, engines=1, state_dir=tmp_path / "state", ports=ports))
    assert up_message(fleet).splitlines()[0] == (
        "fleet is up: Runs API http://127.0.0.1:9400 (gRPC 127.0.0.1:9403), router http://127.0.0.1:9406, "
        "engines http://127.0.0.1:9407"
    )


def test_a_bad_base_port_is_refused_before_the_model_is_written(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    assert main(["up", "--base-port", "65530", "--state-dir", str(state_dir)]) == 2
    assert not state_dir.exists()


def test_the_router_follows_prefix_caches_only_where_the_engines_keep_them() -> None:
    assert router_policy("sglang") == "cache_aware"
    assert router_policy("transformers") == "least_load"
