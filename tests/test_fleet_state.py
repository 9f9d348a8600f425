"""fleet.json outlives its processes when `rlfleet up` is killed or the machine restarts, and pids are
reused: `rlfleet down` signals a recorded pid only while it still names the recorded process, gives each
service SIGTERM and time to stop before it kills it, and `up` takes a state directory over from a fleet
that is gone, never from one whose services still run (nor removes a record it did not write)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rlfleet import local_fleet
from rlfleet.cli.down import stop_from_state
from rlfleet.cli.fleet import run_fleet
from rlfleet.cli.main import main
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.process_identity import start_time
from rlfleet.processes import ServiceProcess, ServiceStartError, process_runs
from rlfleet.redis_claim import claim_key

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def sleepers(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    """Two processes standing in for a fleet's `rlfleet up` and one of its services."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [ServiceProcess(f"sleeper-{i}", argv, tmp_path / f"{i}.log") for i in range(2)]
    yield procs
    for proc in procs:
        proc.stop(timeout=5)


def record(
    state_dir: Path, owner: ServiceProcess, service: ServiceProcess, shift_s: float = 0.0, **more: ServiceProcess
) -> None:
    """A fleet.json naming `owner` as `rlfleet up` and `service` as its engine (and `more` services by name,
    started after it); `shift_s` moves the recorded start times, as if other processes had had these pids."""
    services = {"engine-0": service, **more}
    started = {"up": start_time(owner.pid), **{name: start_time(proc.pid) for name, proc in services.items()}}
    state = {
        "pid": owner.pid,
        "state": "up",
        "processes": {name: proc.pid for name, proc in services.items()},
        "started": {name: t + shift_s for name, t in started.items() if t is not None},
    }
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "fleet.json").write_text(json.dumps(state))


def fleet_in(tmp_path: Path) -> LocalFleet:
    """A fleet of a stand-in model on free ports whose start stops at its first step: no Redis answers."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return LocalFleet(
        FleetConfig(
            model_path=model, state_dir=tmp_path / "state", ports=FleetPorts.free(2), redis_url="redis://127.0.0.1:1/0"
        )
    )


def test_down_leaves_alone_processes_that_only_have_the_recorded_pids(
    tmp_path: Path, sleepers: list[ServiceProcess]
) -> None:
    owner, service = sleepers
    record(tmp_path, owner, service, shift_s=-3600)
    assert stop_from_state(tmp_path, say=print)
    assert owner.alive() and service.alive()
    assert not (tmp_path / "fleet.json").exists()


def test_down_with_no_fleet_recorded_has_nothing_to_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As a second `down` after a first: it exited 1 with a line that was not an error's."""
    assert main(["down", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no fleet recorded in {tmp_path / 'fleet.json'}: nothing to stop\n"


def test_down_stops_the_recorded_processes(tmp_path: Path, sleepers: list[ServiceProcess]) -> None:
    owner, service = sleepers
    record(tmp_path, owner, service)
    assert stop_from_state(tmp_path, say=print)
    owner.proc.wait(timeout=5)
    service.proc.wait(timeout=5)
    assert not (tmp_path / "fleet.json").exists()


def test_down_resumes_an_up_suspended_with_ctrl_z_so_it_stops_its_fleet(
    tmp_path: Path, sleepers: list[ServiceProcess]
) -> None:
    """A suspended owner kept the SIGTERM pending: `down` waited out its whole bound (30 s and more)."""
    _, service = sleepers
    removes_record_on_sigterm = (
        "import pathlib, signal, sys, time\n"
        f"def stop(*_):\n    pathlib.Path({str(tmp_path / 'fleet.json')!r}).unlink()\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
    )
    owner = ServiceProcess("up", [sys.executable, "-c", removes_record_on_sigterm], tmp_path / "up.log")
    try:
        time.sleep(0.5)  # its handler is installed
        record(tmp_path, owner, service)
        os.killpg(owner.pid, signal.SIGSTOP)
        started = time.monotonic()
        assert stop_from_state(tmp_path, say=print)
        assert time.monotonic() - started < 10
        assert owner.proc.wait(timeout=5) == 0  # it stopped itself, through its handler
    finally:
        owner.stop(timeout=5)


def test_up_refuses_a_state_dir_whose_fleet_runs_and_takes_over_a_stale_one(
    tmp_path: Path, sleepers: list[ServiceProcess]
) -> None:
    owner, service = sleepers
    fleet = fleet_in(tmp_path)
    record(tmp_path / "state", owner, service)
    with pytest.raises(
        ServiceStartError, match=rf"a fleet started from .* is up \(`rlfleet up` or `rlfleet demo`, pid {owner.pid}\)"
    ):
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


def spawn_with_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A process of this test (another program, as far as the fleet knows) given `pid` by the kernel, as pid reuse
    would; None where this user cannot choose the next pid, or another process took it first each time."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(5):
        try:
            last_pid.write_text(str(pid - 1))
        except OSError:
            return None
        other = subprocess.Popen(["sleep", "30"])
        if other.pid == pid:
            return other
        other.kill()
        other.wait(timeout=10)
    return None


def test_stopping_a_crashed_service_does_not_signal_the_process_that_took_its_pid(
    tmp_path: Path,
) -> None:
    """The supervisor reaps a crashed service, waits its backoff, then restarts it: stopping it first sent SIGTERM to
    its pid, which by then the kernel could have given to any other process of the user."""
    fleet = fleet_in(tmp_path)
    crashed = fleet.processes["reward"] = ServiceProcess(
        "reward", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "r.log"
    )
    crashed.proc.wait(timeout=30)
    other = spawn_with_pid(crashed.pid)
    if other is None:
        pytest.skip("the next pid cannot be chosen here (/proc/sys/kernel/ns_last_pid)")
    try:
        assert crashed.stop(timeout=5) == 3
        fleet.stop()
        time.sleep(0.3)
        assert other.poll() is None, "the process that took the crashed service's pid was signalled"
    finally:
        other.kill()
        other.wait(timeout=10)


def with_a_service_that_cannot_be_stopped(
    fleet: LocalFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, ServiceProcess]:
    """Gives `fleet` reward, rollout and router (recorded in fleet.json), rollout still there 10 s after SIGKILL (stuck
    in the kernel): its stop times out and killing its group does not end it. The caller stops them all."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    for name in ("reward", "rollout", "router"):
        fleet.processes[name] = ServiceProcess(name, argv, tmp_path / f"{name}.log")
    fleet._write_state()
    stuck = fleet.processes["rollout"]

    def cannot_stop(timeout: float = 10.0) -> int | None:
        raise subprocess.TimeoutExpired(stuck.argv, 10)

    monkeypatch.setattr(stuck, "stop", cannot_stop)
    monkeypatch.setattr(local_fleet, "_kill_group", lambda process: None)
    return dict(fleet.processes)


def test_a_service_that_cannot_be_stopped_leaves_the_others_stopped_and_the_record_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service still there 10 s after SIGKILL (stuck in the kernel) made stop() raise: the services after
    it were never stopped and fleet.json, which `rlfleet down` needs to try again, was left unmanaged."""
    fleet = fleet_in(tmp_path)
    procs = with_a_service_that_cannot_be_stopped(fleet, tmp_path, monkeypatch)
    stuck = procs["rollout"]
    try:
        with caplog.at_level("INFO", logger="rlfleet.local_fleet"):
            assert fleet.stop() == ["rollout"]
        assert not procs["router"].alive() and not procs["reward"].alive()  # stopped before and after it
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"could not stop rollout (pid {stuck.pid})") for m in messages), messages
        assert any(m.startswith("rollout still running:") for m in messages), messages
        state = json.loads((tmp_path / "state" / "fleet.json").read_text())
        assert state["processes"]["rollout"] == stuck.pid
    finally:
        monkeypatch.undo()
        stuck.stop(timeout=5)


def test_up_whose_stop_left_a_service_running_says_so_and_fails_instead_of_fleet_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlfleet up` printed "fleet stopped" and exited 0 right after stop() had logged rollout as still running."""
    fleet = fleet_in(tmp_path)
    procs = with_a_service_that_cannot_be_stopped(fleet, tmp_path, monkeypatch)
    monkeypatch.setattr(fleet, "start", lambda: None)  # the fleet above stands for one that started
    fleet.request_stop()  # as Ctrl-C once it is up
    try:
        assert run_fleet(fleet) == 1
        out, err = capsys.readouterr()
        assert "fleet stopped" not in out, out
        assert (
            f"rlfleet: error: rollout still running after the fleet's stop ({tmp_path / 'state' / 'fleet.json'} "
            f"names them): stop them with `rlfleet down --state-dir {tmp_path / 'state'}`"
        ) in err, err
    finally:
        monkeypatch.undo()
        for proc in procs.values():
            proc.stop(timeout=5)


def test_up_whose_failed_start_left_a_service_running_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that fails stops what it started; what that stop left running was not said ("the fleet did not
    start" alone), as if nothing of the fleet were left for `rlfleet down`."""
    fleet = fleet_in(tmp_path)
    procs: dict[str, ServiceProcess] = {}

    def start_all() -> None:
        procs.update(with_a_service_that_cannot_be_stopped(fleet, tmp_path, monkeypatch))
        raise ServiceStartError("router did not become healthy")

    monkeypatch.setattr(fleet, "_start_all", start_all)
    try:
        assert run_fleet(fleet) == 1
        err = capsys.readouterr().err
        assert "rlfleet: error: the fleet did not start: router did not become healthy" in err, err
        assert f"rollout still running after the fleet's stop ({tmp_path / 'state' / 'fleet.json'} names them)" in err
    finally:
        monkeypatch.undo()
        for proc in procs.values():
            proc.stop(timeout=5)


def test_an_interrupt_while_stopping_one_service_stops_every_service_then_is_raised_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A KeyboardInterrupt (Ctrl-C) while stop() waited on one service escaped it: that service, which had ignored
    SIGTERM, and every service after it in the stop order ran on, and `rlfleet down` had no record to find them by."""
    fleet = fleet_in(tmp_path)
    ready = tmp_path / "ready"
    ignores_sigterm = (
        "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).write_text('1'); time.sleep(60)"
    )
    sleeps = [sys.executable, "-c", "import time; time.sleep(60)"]
    for name in ("reward", "rollout"):
        fleet.processes[name] = ServiceProcess(name, sleeps, tmp_path / f"{name}.log")
    stubborn = fleet.processes["router"] = ServiceProcess(
        "router", [sys.executable, "-c", ignores_sigterm], tmp_path / "router.log"
    )  # stopped first, with 20 s to go
    procs = dict(fleet.processes)
    fleet._write_state()
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and stubborn.alive(), stubborn.log_tail()
        time.sleep(0.05)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a plain `python` process
    try:
        started = time.monotonic()
        signal_me_in(1.0, signal.SIGINT)
        with caplog.at_level("INFO", logger="rlfleet.local_fleet"), pytest.raises(KeyboardInterrupt) as raised:
            fleet.stop()
        assert time.monotonic() - started < 15  # the interrupted wait was not waited out
        for name, proc in procs.items():
            proc.proc.wait(timeout=10)  # TimeoutExpired: the service runs on
            assert not process_runs(proc.pid), name
        assert f"while stopping router (pid {stubborn.pid})" in raised.value.__notes__
        messages = [r.getMessage() for r in caplog.records]
        assert "stopped rollout" in messages and "stopped reward" in messages, messages
        assert not any("still running" in m for m in messages), messages
        assert not (tmp_path / "state" / "fleet.json").exists()  # nothing is left for `rlfleet down`
    finally:
        signal.signal(signal.SIGINT, before)
        for proc in procs.values():
            proc.stop(timeout=5)


def signal_me_in(seconds: float, signum: int) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signum)).start()


def test_up_refuses_a_state_dir_whose_up_was_killed_but_whose_services_run(
    tmp_path: Path, sleepers: list[ServiceProcess]
) -> None:
    """A second `up` beside the orphans would overwrite their record (on failure delete it), and `down` would
    then find no fleet to stop."""
    owner, service = sleepers
    record(tmp_path / "state", owner, service)
    owner.stop(timeout=5)  # `rlfleet up` killed; its engine runs on
    recorded = (tmp_path / "state" / "fleet.json").read_text()
    with pytest.raises(
        ServiceStartError,
        match=rf"still runs without the process that started it \(pid {owner.pid}\): engine-0 \(pid {service.pid}\); "
        rf"stop it with `rlfleet down --state-dir {tmp_path / 'state'}`",
    ):
        fleet_in(tmp_path).start()
    assert (tmp_path / "state" / "fleet.json").read_text() == recorded


def test_a_fleet_never_removes_a_record_it_did_not_write(tmp_path: Path, sleepers: list[ServiceProcess]) -> None:
    owner, service = sleepers
    record(tmp_path / "state", owner, service)
    fleet_in(tmp_path).stop()
    assert (tmp_path / "state" / "fleet.json").exists()


SIGTERM_THEN_EXIT = (
    "import pathlib, signal, sys, time\n"
    "def stop(*_):\n"
    "    time.sleep(0.5)  # a checkpoint\n"
    "    pathlib.Path(sys.argv[1]).write_text('stopped on SIGTERM')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "time.sleep(60)\n"
)


def test_down_without_its_up_gives_each_service_sigterm_and_kills_only_one_that_outlasts_its_bound(
    tmp_path: Path, sleepers: list[ServiceProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, stubborn = sleepers
    stubborn.stop(timeout=5)
    stubborn = ServiceProcess(
        "engine-0",
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
        tmp_path / "stubborn.log",
    )
    graceful = ServiceProcess(
        "trainer", [sys.executable, "-c", SIGTERM_THEN_EXIT, str(tmp_path / "done")], tmp_path / "t.log"
    )
    try:
        time.sleep(1.0)  # both have installed their handlers
        record(tmp_path, owner, stubborn, trainer=graceful)
        owner.stop(timeout=5)  # `rlfleet up` is gone
        monkeypatch.setattr(local_fleet, "STOP_TIMEOUT_S", 1.0)
        said: list[str] = []
        started = time.monotonic()
        assert stop_from_state(tmp_path, say=said.append)
        assert time.monotonic() - started < 15
        assert (tmp_path / "done").read_text() == "stopped on SIGTERM"
        assert graceful.proc.wait(timeout=5) == 0 and stubborn.proc.wait(timeout=5) == -9
        assert said == [
            f"the process that started the fleet (pid {owner.pid}) is gone: stopping its services one by one",
            f"stopping trainer (pid {graceful.pid}) ...",
            "trainer stopped",
            f"stopping engine-0 (pid {stubborn.pid}) ...",
            "engine-0 did not stop within 1 s of SIGTERM: killed",
        ]
        assert not (tmp_path / "fleet.json").exists()
    finally:
        stubborn.stop(timeout=1)
        graceful.stop(timeout=1)


def test_down_keeps_the_record_and_fails_when_a_service_outlives_its_sigkill(
    tmp_path: Path, sleepers: list[ServiceProcess], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`rlfleet down` said "fleet stopped" (exit 0) and removed fleet.json after a SIGKILL whatever it did: a service
    stuck in the kernel ran on with no record left to find it by."""
    from rlfleet.cli import down

    owner, service = sleepers
    record(tmp_path, owner, service)
    owner.stop(timeout=5)  # `rlfleet up` is gone
    monkeypatch.setattr(local_fleet, "STOP_TIMEOUT_S", 0.5)
    monkeypatch.setattr(down, "send_stop", lambda pid: True)  # SIGTERM does not reach it ...
    monkeypatch.setattr(down.os, "killpg", lambda pid, sig: None)  # ... nor SIGKILL
    monkeypatch.setattr(down, "KILLED_WITHIN_S", 0.2)
    assert main(["down", "--state-dir", str(tmp_path)]) == 1
    printed = capsys.readouterr()
    assert "engine-0 still running after SIGKILL" in printed.out and "fleet stopped" not in printed.out
    assert f"rlfleet down --state-dir {tmp_path}` again" in printed.err
    assert process_runs(service.pid) and (tmp_path / "fleet.json").exists()


def test_the_trainer_has_time_to_checkpoint_before_it_is_killed() -> None:
    """On SIGTERM the trainer's gRPC server gets 5 s and its runs up to 30 s to end their step and checkpoint
    (rlfleet_trainer's serve, TrainerCore.shutdown); the orchestrator may wait out a trainer call of up to 30 s."""
    assert local_fleet.stop_timeout_s("trainer") >= 45 and local_fleet.stop_timeout_s("rollout") >= 45
    assert local_fleet.stop_timeout_s("engine-0") == local_fleet.STOP_TIMEOUT_S


@pytest.mark.parametrize("holder", ["this fleet", "another fleet"])
def test_down_after_a_killed_up_releases_its_claim_of_the_key_prefix_and_no_other(
    tmp_path: Path, sleepers: list[ServiceProcess], redis_client: redis.Redis, redis_prefix: str, holder: str
) -> None:
    owner, service = sleepers
    record(tmp_path, owner, service)
    state = json.loads((tmp_path / "fleet.json").read_text())
    state["config"] = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "host": "127.0.0.1", "ports": {}}
    (tmp_path / "fleet.json").write_text(json.dumps(state))
    # What RedisClaim stores; another fleet's claim (the lapsed one taken over) names another state dir.
    held_by = tmp_path if holder == "this fleet" else tmp_path / "elsewhere"
    claim = json.dumps({"token": "t", "host": socket.gethostname(), "pid": owner.pid, "state_dir": str(held_by)})
    redis_client.set(claim_key(redis_prefix), claim, px=30_000)
    owner.stop(timeout=5)  # `rlfleet up` killed: its claim is renewed no more but would hold for up to 30 s
    said: list[str] = []
    assert stop_from_state(tmp_path, say=said.append)
    assert not process_runs(service.pid)
    if holder == "this fleet":
        assert redis_client.get(claim_key(redis_prefix)) is None
        assert said[-1] == f"released key prefix {redis_prefix!r} at Redis {REDIS_URL}", said
    else:
        assert redis_client.get(claim_key(redis_prefix)) == claim.encode()
        assert not any("released" in line for line in said), said


@pytest.mark.parametrize("command", [["down"], ["runs"], ["up", "--free-ports"]])
def test_a_state_dir_that_is_a_file_is_named_as_such(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "state"
    afile.write_text("notes\n")
    assert main([*command, "--state-dir", str(afile)]) != 0
    assert f"state dir {afile} is a file, not a directory; choose another --state-dir" in capsys.readouterr().err
    assert afile.read_text() == "notes\n"


@pytest.mark.parametrize("content", [{}, {"pid": "1234", "state": "up"}, {"pid": None, "processes": {}}])
@pytest.mark.parametrize("command", [["down"], ["runs", "--timeout", "1"]])
def test_a_fleet_json_without_an_owner_pid_is_named_as_not_a_fleet_record(
    tmp_path: Path, command: list[str], content: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """`down` ended in a traceback on it (KeyError, TypeError), `runs` in an error that named no file or blamed
    the default address."""
    (tmp_path / "fleet.json").write_text(json.dumps(content))
    assert main([*command, "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'fleet.json'} is not a fleet record" in err, err
    assert "delete it if no fleet runs" in err
    assert json.loads((tmp_path / "fleet.json").read_text()) == content


@pytest.mark.parametrize("scratch", [True, False])
def test_down_after_a_killed_demo_deletes_its_scratch_keys(
    tmp_path: Path, sleepers: list[ServiceProcess], redis_client: redis.Redis, redis_prefix: str, scratch: bool
) -> None:
    """A demo deletes its keys when it stops; killed, it left them for good, as `down` stopped its services only."""
    owner, service = sleepers
    record(tmp_path, owner, service)
    state = json.loads((tmp_path / "fleet.json").read_text())
    prefix = f"{redis_prefix}demo:"
    state["config"] = {
        "redis_url": REDIS_URL,
        "redis_prefix": prefix,
        "host": "127.0.0.1",
        "ports": {},
        "scratch_keys": scratch,
    }
    (tmp_path / "fleet.json").write_text(json.dumps(state))
    redis_client.set(f"{prefix}run:r1:record", "x")
    redis_client.set(f"{redis_prefix}other", "y")
    owner.stop(timeout=5)
    assert stop_from_state(tmp_path, say=print)
    assert (redis_client.get(f"{prefix}run:r1:record") is None) == scratch
    assert redis_client.get(f"{redis_prefix}other") == b"y"
