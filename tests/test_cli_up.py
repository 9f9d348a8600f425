"""`rlfleet up` while it is still starting: `rlfleet down` stops it (fleet.json records `up` before it creates
the model, then each process as it starts), and Ctrl-C ends it cleanly (a message, no traceback, status 130).
Both stop every child. Once up, it says where the Runs API listens on both transports; bad flags (a --base-port
out of range, no engines, no trainer ranks, a Redis that refuses) are refused before anything is written. A
fleet whose `up` was killed keeps its record: a second `up` refuses the state directory, and `down` stops the
services one by one, each on SIGTERM. A Redis key prefix another live fleet holds on the same Redis is refused
before any service starts, naming that fleet."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from rlfleet import processes
from rlfleet.cli.fleet import EXAMPLE_SPEC, default_model, up_message
from rlfleet.cli.main import main
from rlfleet.cli.steps import run_step
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet, router_policy
from rlfleet.processes import group_runs
from rlfleet.redis_claim import RedisClaim, claim_key

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


def test_a_bad_base_port_is_refused_before_the_model_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "state"
    assert main(["up", "--base-port", "65530", "--state-dir", str(state_dir)]) == 2
    assert not state_dir.exists()
    # A range over Redis's port was blamed on another fleet ("port already in use: 6379 (trainer gRPC)").
    assert main(["up", "--base-port", "6375", "--state-dir", str(state_dir)]) == 2
    assert "--base-port 6375: the fleet's ports 6375-6383 include Redis's 6379" in capsys.readouterr().err
    assert not state_dir.exists()


@pytest.mark.parametrize("argv", [["up"], ["up", "--free-ports"], ["demo"]])
def test_more_engines_than_ports_is_refused_naming_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """--engines 30000 ran the engines' ports past 65535: `up` left fleet.json behind with an error naming no flag,
    and --free-ports (as `demo`) failed with randrange's `empty range for randrange() (15000, 12769, -2231)`."""
    state_dir = tmp_path / "state"
    where = ["--state-dir", str(state_dir)] if argv[0] == "up" else ["--out", str(tmp_path / "demo")]
    with pytest.raises(SystemExit) as refused:  # argparse's refusal
        main([*argv, "--engines", "30000", *where])
    status = refused.value.code
    assert status == 2
    assert "argument --engines: one machine's fleet runs at most 256 engines, got 30000" in capsys.readouterr().err
    assert not state_dir.exists() and not (tmp_path / "demo").exists()


def test_a_busy_port_is_refused_before_the_model_is_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / "state"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        router = taken.getsockname()[1]
        base = router - 6  # --base-port puts the router at base + 6
        if base < 1024:
            pytest.skip(f"port {router} leaves no base port in range")
        assert main(["up", "--base-port", str(base), "--state-dir", str(state_dir)]) == 1
    said = capsys.readouterr().err
    assert "already in use on 127.0.0.1: " in said and f"{router} (router)" in said, said
    assert not (state_dir / "models").exists() and not (state_dir / "fleet.json").exists()


def test_a_model_path_without_a_model_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "state"
    for model in (tmp_path / "nowhere", tmp_path):  # missing; a directory without config.json
        assert main(["up", "--model-path", str(model), "--free-ports", "--state-dir", str(state_dir)]) == 2
        assert capsys.readouterr().err == (
            f"rlfleet: error: --model-path {model}: no Hugging Face model there (config.json missing)\n"
        )
        assert not state_dir.exists()


def test_up_names_the_default_model_where_it_ends_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The model is written beside its place and moved there: the path it was written to is not worth showing."""

    def write_model(name: str, out: Path, quiet: bool = False) -> None:  # says where it wrote, as `model init` does
        program = "import pathlib, sys; out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True); "
        program += "(out / 'config.json').write_text('{}'); print('wrote a model to', out)"
        run_step(name, [sys.executable, "-c", program, str(out)], timeout_s=60, quiet=quiet)

    monkeypatch.setattr("rlfleet.cli.fleet.write_tiny_model", write_model)
    # What a creation killed with its `up` left (its pid no longer runs), and one under way in another `up`.
    killed, under_way = (tmp_path / "models" / f".tiny.{pid}" for pid in (dead_pid(), os.getppid()))
    for partial in (killed, under_way):
        partial.mkdir(parents=True)
        (partial / "model.safetensors").write_text("half")
    model = default_model(tmp_path)
    out, err = capfd.readouterr()
    assert model == tmp_path / "models" / "tiny" and (model / "config.json").is_file()
    assert out.splitlines() == [f"creating the tiny model in {model}", f"created the tiny model in {model}"]
    assert ".tiny." not in out + err
    assert not killed.exists() and under_way.exists()


def dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def test_the_router_follows_prefix_caches_only_where_the_engines_keep_them() -> None:
    assert router_policy("sglang") == "cache_aware"
    assert router_policy("transformers") == "least_load"


@pytest.mark.e2e
def test_down_stops_an_up_that_is_still_creating_its_model(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    up = subprocess.Popen(
        rlfleet("up", "--free-ports", "--engines", "1", "--state-dir", str(state_dir), "--redis-url", REDIS_URL)
        + ["--redis-prefix", f"rlfleet-test:{uuid.uuid4().hex}:"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (state_dir / "fleet.json").exists():
            assert up.poll() is None, f"rlfleet up exited with {up.returncode}: {up.communicate()}"
            assert time.monotonic() < deadline, "rlfleet up recorded nothing within 60 s"
            time.sleep(0.02)
        assert not (state_dir / "models" / "tiny" / "config.json").exists(), "recorded only once the model was made"
        state = json.loads((state_dir / "fleet.json").read_text())
        assert (state["pid"], state["state"], state["processes"]) == (up.pid, "starting", {})
        down = subprocess.run(
            rlfleet("down", "--state-dir", str(state_dir)), capture_output=True, text=True, timeout=90
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert "starting" in down.stdout and "fleet stopped" in down.stdout
        out, err = up.communicate(timeout=60)
        assert up.returncode == 128 + signal.SIGTERM, out + err
        assert "SIGTERM" in err and "Traceback" not in err
        assert not (state_dir / "fleet.json").exists()
        assert not (state_dir / "logs").exists(), "a service was started"
        assert not (state_dir / "models" / "tiny").exists(), "a model half written would be served next time"
    finally:
        stop_by_pid(up, state_dir)


def stop_by_pid(up: subprocess.Popen[str], state_dir: Path) -> None:
    """`up` asked to stop its fleet, killed after a bound, and whatever is still recorded killed by pid."""
    if up.poll() is None:
        up.terminate()
        try:
            up.wait(timeout=200)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(timeout=10)
    if (state_dir / "fleet.json").exists():
        for pid in recorded_pids(state_dir):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--engines", "0"], "argument --engines: must be >= 1, got 0"),
        (["--trainer-ranks", "0"], "argument --trainer-ranks: must be >= 1, got 0"),
        (["--redis-url", "redis://127.0.0.1:6379/99"], "answered with an error: DB index is out of range"),
        (["--redis-url", "http://127.0.0.1:6379/0"], "--redis-url http://127.0.0.1:6379/0: Redis URL must specify"),
        (["--redis-prefix", ""], "argument --redis-prefix: must not be empty"),
        (["--startup-timeout", "0"], "argument --startup-timeout: must be a finite number > 0, got 0"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_written_or_started(
    tmp_path: Path, flags: list[str], said: str
) -> None:
    state_dir = tmp_path / "state"  # the model would be created there first
    up = subprocess.run(
        rlfleet("up", "--free-ports", "--engines", "1")
        + [
            "--state-dir",
            str(state_dir),
            "--redis-url",
            REDIS_URL,
            "--redis-prefix",
            f"rlfleet-test:{uuid.uuid4().hex}:",
        ]
        + flags,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 2, up.stdout + up.stderr
    assert said in up.stderr and "does not answer" not in up.stderr and "Traceback" not in up.stderr
    assert not state_dir.exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_fleet_whose_up_was_killed_is_kept_from_a_second_up_and_down_stops_it_gently(
    tmp_path: Path, small_model_dir: Path, redis_client: redis.Redis
) -> None:
    state_dir = tmp_path / "state"
    prefix = f"rlfleet-test:{uuid.uuid4().hex}:"
    up_command = rlfleet("up", "--free-ports", "--engines", "1", "--model-path", str(small_model_dir))
    up_command += ["--state-dir", str(state_dir), "--redis-url", REDIS_URL, "--redis-prefix", prefix]
    up = subprocess.Popen(up_command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while (
            not (state_dir / "fleet.json").exists()
            or json.loads((state_dir / "fleet.json").read_text())["state"] != "up"
        ):
            assert up.poll() is None, f"rlfleet up exited with {up.returncode}: {up.communicate()}"
            assert time.monotonic() < deadline, "the fleet was not up within 300 s"
            time.sleep(0.5)
        # Its reward hub lets `judge` grade on this fleet's router (on free ports, not the default 30000).
        record = json.loads((state_dir / "fleet.json").read_text())
        judge = {"function": "judge", "params": {"router_url": record["router_url"]}}
        checked = httpx.post(f"{record['reward_url']}/validate", json={"spec": {"terms": [judge]}}, timeout=30)
        assert checked.json() == {"problems": []}, checked.text
        up.kill()  # `up` alone: its services run on, in sessions of their own
        up.wait(timeout=10)
        recorded = (state_dir / "fleet.json").read_text()
        pids = recorded_pids(state_dir)

        second = subprocess.run(up_command, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "still runs without the process that started it" in second.stderr
        assert f"rlfleet down --state-dir {state_dir}" in second.stderr
        assert (state_dir / "fleet.json").read_text() == recorded

        down = subprocess.run(
            rlfleet("down", "--state-dir", str(state_dir)), capture_output=True, text=True, timeout=300
        )
        assert down.returncode == 0, down.stdout + down.stderr
        said = down.stdout.splitlines()
        assert f"the process that started the fleet (pid {up.pid}) is gone: stopping its services one by one" in said
        assert [line for line in said if line.endswith(" stopped") and line != "fleet stopped"] == [
            f"{name} stopped" for name in ("rollout", "trainer", "reward", "router", "engine-0")
        ], down.stdout  # each stopped on SIGTERM, in reverse order
        assert "killed" not in down.stdout
        assert not [pid for pid in pids if group_runs(pid)]
        assert not (state_dir / "fleet.json").exists()
        # The killed `up` renews its claim of the key prefix no more; down deleted it rather than let it hold 30 s.
        assert f"released key prefix {prefix!r} at Redis {REDIS_URL}" in said
        assert not redis_client.exists(claim_key(prefix))
    finally:
        stop_by_pid(up, state_dir)
        keys = list(redis_client.scan_iter(match=f"{prefix}*"))
        if keys:
            redis_client.delete(*keys)


def test_up_refuses_a_redis_prefix_another_fleet_holds_before_it_makes_its_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_client: redis.Redis
) -> None:
    """Two fleets on one prefix would share the run queue, the run records and the sample streams; the claim was
    found only once the fleet started, after the model was made."""
    prefix = f"rlfleet-test:{uuid.uuid4().hex}:"
    other = RedisClaim(REDIS_URL, prefix, tmp_path / "other")
    other.acquire()
    try:
        state_dir = tmp_path / "state"
        argv = ["up", "--free-ports", "--engines", "1", "--state-dir", str(state_dir)]
        assert main([*argv, "--redis-url", REDIS_URL, "--redis-prefix", prefix]) == 1
    finally:
        other.release()
        redis_client.delete(claim_key(prefix))
    said = capsys.readouterr().err
    assert said.startswith("rlfleet: error: the fleet did not start: ") and "Traceback" not in said, said
    assert f"Redis {REDIS_URL} with key prefix {prefix!r} is held by another fleet" in said, said
    assert f"state dir {tmp_path / 'other'}; stop it with `rlfleet down --state-dir {tmp_path / 'other'}`" in said
    assert not (state_dir / "models").exists(), "no model was made"
    assert not (state_dir / "logs").exists(), "no service was started"
    assert not (state_dir / "fleet.json").exists()


def test_a_long_wait_for_a_service_says_that_it_still_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine loading its model, the trainer importing torch: `up` said nothing between starting a service and
    its being healthy, for minutes with SGLang."""
    monkeypatch.setattr(processes, "PROGRESS_EVERY_S", 0.5, raising=False)
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]  # still loading when the wait ends
    service = processes.ServiceProcess("trainer", slow, tmp_path / "trainer.log")
    try:
        with caplog.at_level("INFO", logger="rlfleet.processes"), pytest.raises(processes.ServiceStartError):
            service.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=1.8)
    finally:
        service.stop(timeout=5)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still waiting")]
    assert said, [r.getMessage() for r in caplog.records]
    assert said[0].startswith(f"still waiting for trainer to be healthy at http://127.0.0.1:{port}/health (last try: ")
    assert said[0].endswith(f"s of at most 2 s; log {tmp_path / 'trainer.log'})")
