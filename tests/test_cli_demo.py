"""`rlfleet demo`: it deletes only a previous demo's directory (or one the user says it may), never one whose
fleet still runs; each demo has Redis options like `rlfleet up` and a key prefix of its own, removed
afterwards, also when SIGTERM or `rlfleet down` stops it; its watch prints a progress line only when it
changes; bad flags are refused before any work, and a step that fails is one line naming it."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import redis

from rlfleet.cli.demo import MARKER, fleet_config, recreate, supervised_watch, watch
from rlfleet.cli.down import delete_keys
from rlfleet.cli.main import build_parser, main
from rlfleet.cli.steps import StepFailed
from rlfleet.fleet_supervisor import RestartPolicy
from rlfleet.local_fleet import LocalFleet
from rlfleet.local_spec_check import (
    ENVIRONMENTS,
    GROUP_FILTERS,
    REWARD_FUNCTIONS,
    ROLLOUT_FUNCTIONS,
    check_spec_here,
    registered,
)
from rlfleet.process_identity import start_time
from rlfleet.processes import ServiceProcess, group_runs, process_runs
from rlfleet.redis_claim import RedisClaim
from rlfleet.runs_client import RunsClient, WatchEnded, load_spec_file
from rlfleet.v1.runs_pb2 import Run, RunProgress, RunState
from rlfleet_reward.registry import ENTRY_POINT_GROUP as REWARD_FUNCTION_GROUP
from rlfleet_rollout.environment import ENTRY_POINT_GROUP as ENVIRONMENT_GROUP
from rlfleet_rollout.group_filters import ENTRY_POINT_GROUP as GROUP_FILTER_GROUP
from rlfleet_rollout.rollout_function import FUNCTION_GROUP as ROLLOUT_FUNCTION_GROUP

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "runs"


def demo_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *argv])


def test_a_directory_that_is_not_a_demo_is_refused_and_kept(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    demo = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "demo", "--out", str(precious)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert f"is not a previous demo's directory (it has no {MARKER})" in demo.stderr and "--overwrite" in demo.stderr
    assert (precious / "notes.txt").read_text() == "mine"


def test_a_previous_demo_an_empty_or_a_missing_directory_is_recreated_with_the_marker(tmp_path: Path) -> None:
    previous = tmp_path / "previous"
    recreate(previous, overwrite=False)
    (previous / "summary.json").write_text("{}")
    recreate(previous, overwrite=False)
    assert [p.name for p in previous.iterdir()] == [MARKER]
    (tmp_path / "empty").mkdir()
    recreate(tmp_path / "empty", overwrite=False)
    assert (tmp_path / "empty" / MARKER).exists()


def test_a_demo_from_before_the_marker_is_recognised_by_what_it_holds(tmp_path: Path) -> None:
    old = tmp_path / "old"
    for name in ("base", "sft", "fleet"):
        (old / name).mkdir(parents=True)
    (old / "summary.json").write_text("{}")
    recreate(old, overwrite=False)
    assert [p.name for p in old.iterdir()] == [MARKER]
    (old / "summary.json").write_text("{}")
    (old / "notes.txt").write_text("mine")
    (old / MARKER).unlink()
    with pytest.raises(FileExistsError):
        recreate(old, overwrite=False)


def test_overwrite_deletes_any_directory(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        recreate(other, overwrite=False)
    recreate(other, overwrite=True)
    assert [p.name for p in other.iterdir()] == [MARKER]


def test_each_demo_has_its_own_redis_prefix_unless_given_one(tmp_path: Path) -> None:
    first, second = (fleet_config(demo_args(), tmp_path) for _ in range(2))
    assert first.redis_prefix.startswith("rlfleet-demo-") and first.redis_prefix != second.redis_prefix
    assert first.redis_url is None  # as `rlfleet up`: 127.0.0.1:6379, started when none answers
    assert first.scratch_keys, "its keys are deleted when it stops, by `rlfleet down` too"
    given = fleet_config(demo_args("--redis-url", "redis://127.0.0.1:6379/5", "--redis-prefix", "mine:"), tmp_path)
    assert (given.redis_url, given.redis_prefix) == ("redis://127.0.0.1:6379/5", "mine:")
    assert not given.scratch_keys, "a prefix given is the user's: kept"


@pytest.mark.parametrize("state_dir", ["fleet", ".", "runs/a"])
def test_a_directory_holding_a_running_fleets_state_is_kept(tmp_path: Path, state_dir: str) -> None:
    """A second demo with the same --out would delete the first one's logs and weights under its running fleet;
    so would a demo over `rlfleet up --state-dir`, which was checked in out/fleet alone: with --overwrite the
    fleet's record went, and `rlfleet down` could no longer find the fleet, which ran on."""
    out = tmp_path / "demo"
    recreate(out, overwrite=False)
    running = ServiceProcess("demo", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "demo.log")
    try:
        (out / state_dir).mkdir(parents=True, exist_ok=True)
        record = {"pid": running.pid, "state": "up", "processes": {}, "started": {"up": start_time(running.pid)}}
        (out / state_dir / "fleet.json").write_text(json.dumps(record))
        for overwrite in (False, True):
            with pytest.raises(FileExistsError, match=rf"rlfleet down --state-dir {re.escape(str(out / state_dir))}`"):
                recreate(out, overwrite=overwrite)
        assert (out / state_dir / "fleet.json").exists() and (out / MARKER).exists()
    finally:
        running.stop(timeout=5)
    recreate(out, overwrite=True)  # its fleet gone, the directory may go
    assert [p.name for p in out.iterdir()] == [MARKER]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--sft-steps", "-1"], "argument --sft-steps: must be >= 1, got -1"),
        (["--engines", "0", "--sft-steps", "1"], "argument --engines: must be >= 1, got 0"),
        # An empty prefix fell back to a prefix of the demo's own whose keys were then kept, not deleted.
        (["--redis-prefix", ""], "argument --redis-prefix: must not be empty"),
    ],
)
def test_bad_numbers_are_refused_before_any_work(tmp_path: Path, flags: list[str], said: str) -> None:
    out = tmp_path / "demo"
    demo = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "demo", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert said in demo.stderr and "Traceback" not in demo.stderr
    assert not out.exists()


def test_a_redis_prefix_another_fleet_holds_is_refused_before_any_work(
    tmp_path: Path, redis_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not only once the fleet starts and claims it (step 3/5), after minutes of SFT."""
    other = RedisClaim(REDIS_URL, redis_prefix, tmp_path / "other")
    other.acquire()
    try:
        out = tmp_path / "demo"
        code = main(["demo", "--out", str(out), "--redis-url", REDIS_URL, "--redis-prefix", redis_prefix])
    finally:
        other.release()
    said = capsys.readouterr().err
    assert code == 2, said
    assert f"Redis {REDIS_URL} with key prefix {redis_prefix!r} is held by another fleet" in said, said
    assert f"`rlfleet down --state-dir {tmp_path / 'other'}`" in said
    assert not out.exists(), "nothing was made"


SPEC_HEAD = {
    "model": {"path": "ignored: the demo trains its own"},
    "dataset": {"arithmetic": {}},
    "reward": {"terms": [{"function": "arith_exact"}]},
    "schedule": {"steps": 2},
}


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"reward": {"terms": [{"function": "arith_exat"}]}}, "reward.terms[0].function: unknown reward function "),
        ({"rollout": {"group_size": 1}}, "rollout.group_size: must be >= 2"),
        ({"rollout": {"function": "single_trun"}}, "rollout.function: unknown rollout function 'single_trun'; "),
        ({"rollout": {"filters": ["zero_varaince"]}}, "rollout.filters[0]: unknown group filter 'zero_varaince'; "),
        ({"dataset": {"jsonl": {"path": "nowhere.jsonl"}}}, "dataset.jsonl.path: 'nowhere.jsonl' does not exist"),
        (  # the spec file itself stands for a training file that exists
            {"dataset": {"jsonl": {"path": "spec.json", "eval_path": "held.jsonl"}}},
            "dataset.jsonl.eval_path: 'held.jsonl' does not exist",
        ),
        (
            {"dataset": {"arithmetic": {"digits": 1}, "eval_size": 50}},
            "dataset.eval_size: the test split of 1-digit '+' problems holds ",
        ),
    ],
)
def test_a_spec_the_fleet_would_refuse_is_refused_before_any_work(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    changes: dict[str, object],
    said: str,
) -> None:
    """Found at submit, a bad spec cost the minutes of model creation, SFT warm start and fleet start first."""
    monkeypatch.chdir(tmp_path)  # where the demo's orchestrator would read a relative dataset path
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**SPEC_HEAD, **changes}))

    def no_model(*args: object) -> None:
        raise AssertionError("the demo made its model for a spec its fleet would refuse")

    monkeypatch.setattr("rlfleet.cli.demo.warm_start", no_model)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--spec", str(spec)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"rlfleet: error: {spec}: {said}"), error
    if "unknown reward function" in said:
        assert "known: " in error and "arith_exact" in error
    assert not out.exists()


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_the_example_specs_pass_the_demos_checks(example: Path, tmp_path: Path) -> None:
    spec = load_spec_file(example)
    spec.model.path = str(tmp_path / "sft")
    check_spec_here(spec)


def test_the_names_checked_are_those_the_services_register() -> None:
    assert (REWARD_FUNCTIONS, ROLLOUT_FUNCTIONS) == (REWARD_FUNCTION_GROUP, ROLLOUT_FUNCTION_GROUP)
    assert (ENVIRONMENTS, GROUP_FILTERS) == (ENVIRONMENT_GROUP, GROUP_FILTER_GROUP)
    assert "arith_exact" in registered(REWARD_FUNCTIONS) and "single_turn" in registered(ROLLOUT_FUNCTIONS)


def test_a_step_that_fails_is_one_line_naming_it() -> None:
    from rlfleet.cli.steps import StepFailed, run_step

    with pytest.raises(StepFailed, match=r"^2/5 SFT warm start failed: .* exited with code 3; its output is above$"):
        run_step("2/5 SFT warm start", [sys.executable, "-c", "raise SystemExit(3)"], timeout_s=60)


def test_a_step_dies_with_the_command_that_runs_it(tmp_path: Path) -> None:
    """A SIGKILLed `rlfleet demo` left its SFT warm start running for up to half an hour, where the `rlfleet down`
    it printed could not see it."""
    pid_file = tmp_path / "step.pid"
    step = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    runner = (
        "import sys; from rlfleet.cli.steps import run_step; "
        f"run_step('1/5 a step', [sys.executable, '-c', {step!r}], timeout_s=120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", runner])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the step never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process_runs(child):
            assert time.monotonic() < deadline, f"the step (pid {child}) outlived the command that ran it"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_the_demos_keys_and_only_they_are_deleted(redis_client: redis.Redis, redis_prefix: str) -> None:
    url = redis_client.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}"
    redis_client.set(f"{redis_prefix}demo:run:1", "x")
    redis_client.set(f"{redis_prefix}other", "y")
    delete_keys(redis_url, f"{redis_prefix}demo:", print)
    assert redis_client.get(f"{redis_prefix}demo:run:1") is None
    assert redis_client.get(f"{redis_prefix}other") == b"y"


class ScriptedRuns:
    """The two calls the demo's watch makes, answered from a list of run events."""

    def __init__(self, events: list[Run]) -> None:
        self.events = events

    def get(self, run_id: str) -> Run:
        return self.events[0]

    def follow(self, run_id: str, on_lost: object = None) -> Iterator[Run]:
        yield from self.events


def test_the_demo_prints_a_progress_line_only_when_it_changes(capsys: pytest.CaptureFixture) -> None:
    running, done = RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_SUCCEEDED
    events = [
        Run(id="run-1", state=state, progress=RunProgress(step=step, total_steps=2, groups_produced=4 * step))
        for step, state in [(0, running), (1, running), (1, running), (1, running), (2, running), (2, done)]
    ]
    final, _, _ = watch(cast(RunsClient, ScriptedRuns(events)), "run-1")
    assert final.state == done
    lines = capsys.readouterr().out.splitlines()
    assert [re.findall(r"step (\S+) .* (\w+)$", line)[0] for line in lines] == [
        ("0/2", "running"),
        ("1/2", "running"),
        ("2/2", "running"),
        ("2/2", "succeeded"),
    ]


def recorded(state_dir: Path) -> dict[str, int]:
    try:
        return dict(json.loads((state_dir / "fleet.json").read_text())["processes"])
    except (FileNotFoundError, ValueError, KeyError):
        return {}


@pytest.mark.e2e
@pytest.mark.slow
def rlfleet_down(state_dir: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`rlfleet down --state-dir state_dir` in a process of its own, which must succeed."""
    down = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "down", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert down.returncode == 0, down.stdout + down.stderr
    return down


def test_down_stops_a_running_demo_its_fleet_and_its_keys(tmp_path: Path, redis_client: redis.Redis) -> None:
    """Services run in sessions of their own: a demo ended by SIGTERM (`rlfleet down`, a closed terminal)
    without stopping them left the whole fleet training, its Redis keys in place."""
    out = tmp_path / "demo"
    log = tmp_path / "demo.out"
    with log.open("w") as stdout:
        demo = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.cli", "demo", "--out", str(out), "--sft-steps", "1", "--engines", "1"]
            + ["--redis-url", REDIS_URL],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    pids: dict[str, int] = {}
    prefix = ""
    try:
        deadline = time.monotonic() + 400
        while "GRPO run" not in log.read_text():
            assert demo.poll() is None, f"the demo exited with {demo.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the demo submitted no run within 400 s:\n{log.read_text()}"
            pids = recorded(out / "fleet") or pids
            time.sleep(0.5)
        pids = recorded(out / "fleet")
        printed = log.read_text()
        prefix = re.findall(r"Redis keys (\S+)\* at", printed)[0]
        assert list(redis_client.scan_iter(match=f"{prefix}*")), "the run left no keys to delete"
        rlfleet_down(out / "fleet", timeout_s=300)
        assert demo.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
        assert "Traceback" not in log.read_text()
        assert not [name for name, pid in pids.items() if group_runs(pid)]
        assert not (out / "fleet" / "fleet.json").exists()
        assert not list(redis_client.scan_iter(match=f"{prefix}*"))
        assert f"stop it from another shell: rlfleet down --state-dir {out / 'fleet'}" in printed
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=10)
        for pid in (recorded(out / "fleet") or pids).values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if prefix:
            keys = list(redis_client.scan_iter(match=f"{prefix}*"))
            if keys:
                redis_client.delete(*keys)


def test_down_stops_a_demo_still_in_its_sft_warm_start(tmp_path: Path) -> None:
    """Before its fleet starts the demo records itself as a fleet that is starting, as `rlfleet up` does while
    it makes its model: `rlfleet down --state-dir <out>/fleet` used to answer that no fleet was recorded."""
    out = tmp_path / "demo"
    log = tmp_path / "demo.out"
    with log.open("w") as stdout:
        demo = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.cli", "demo", "--out", str(out), "--sft-steps", "100000"]
            + ["--redis-url", REDIS_URL],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "2/5 SFT warm start" not in log.read_text():
            assert demo.poll() is None, f"the demo exited with {demo.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the demo did not reach its SFT within 120 s:\n{log.read_text()}"
            time.sleep(0.2)
        state = json.loads((out / "fleet" / "fleet.json").read_text())
        assert (state["pid"], state["state"], state["processes"]) == (demo.pid, "starting", {})
        assert f"stop it from another shell: rlfleet down --state-dir {out / 'fleet'}" in log.read_text()
        down = rlfleet_down(out / "fleet", timeout_s=90)
        assert "starting" in down.stdout and "fleet stopped" in down.stdout
        assert demo.wait(timeout=30) == 128 + signal.SIGTERM, log.read_text()
        assert "Traceback" not in log.read_text()
        assert not (out / "fleet" / "fleet.json").exists()
        assert not group_runs(demo.pid), "the SFT child outlived the demo"
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=10)


class SilentRuns(ScriptedRuns):
    """A watch that hears nothing until `released` (a run whose trainer died: no step ever comes)."""

    def __init__(self, events: list[Run]) -> None:
        super().__init__(events)
        self.released = threading.Event()

    def follow(self, run_id: str, on_lost: object = None) -> Iterator[Run]:
        self.released.wait(timeout=30)
        yield from self.events


class OneService:
    def __init__(self, process: ServiceProcess) -> None:
        self.processes = {"trainer": process}

    def restart(self, name: str) -> None:
        raise AssertionError("the policy allows no restart")


def test_a_service_that_dies_while_the_demo_watches_ends_the_demo_naming_it(tmp_path: Path) -> None:
    """The demo's fleet had no supervisor: a trainer killed mid-run left the demo waiting, saying nothing."""
    dead = ServiceProcess("trainer", [sys.executable, "-c", "raise SystemExit(9)"], tmp_path / "trainer.log")
    dead.proc.wait(timeout=30)
    runs = SilentRuns([Run(id="run-1", state=RunState.RUN_STATE_RUNNING)])
    started = time.monotonic()
    try:
        with pytest.raises(StepFailed, match=r"4/5 the fleet lost a service: trainer exited with code 9"):
            supervised_watch(
                cast(LocalFleet, OneService(dead)), cast(RunsClient, runs), "run-1", RestartPolicy(max_restarts=0)
            )
    finally:
        runs.released.set()
    assert time.monotonic() - started < 10


def test_a_watch_lost_while_the_demo_watches_ends_the_demo_without_saying_to_follow_again(tmp_path: Path) -> None:
    """The demo stops its fleet when it ends: `rlfleet watch run-1 follows it again` pointed at nothing."""
    run = Run(id="run-1", state=RunState.RUN_STATE_RUNNING, progress=RunProgress(step=4))

    class LosesTheWatch(ScriptedRuns):
        def follow(self, run_id: str, on_lost: object = None) -> Iterator[Run]:
            yield run
            raise WatchEnded(run, "Connection refused; no watch again within 60 s")

    alive = ServiceProcess("trainer", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "t.log")
    try:
        with pytest.raises(StepFailed) as failed:
            supervised_watch(
                cast(LocalFleet, OneService(alive)), cast(RunsClient, LosesTheWatch([run])), "run-1",
                RestartPolicy(),
            )  # fmt: skip
    finally:
        alive.stop(timeout=5)
    assert str(failed.value) == "4/5 lost run run-1 at step 4: Connection refused; no watch again within 60 s"


RESTART_WITH_STDERR_FULL = """
import fcntl, os, socket, sys, threading
from pathlib import Path
from rlfleet.cli.demo import supervised_watch
from rlfleet.cli.stop_signals import StopSignal, raise_on_signals, stop_on_signals
from rlfleet.fleet_supervisor import RestartPolicy
from rlfleet.local_fleet import FleetConfig, LocalFleet
from rlfleet.logs import init_logging
from rlfleet.v1.runs_pb2 import Run

work = Path(sys.argv[1])
init_logging("cli")
(work / "model").mkdir()
(work / "model" / "config.json").write_text("{}")
fleet = LocalFleet(FleetConfig(model_path=work / "model", state_dir=work / "state"))
with socket.socket() as reserved:
    reserved.bind(("127.0.0.1", 0))
    port = reserved.getsockname()[1]
engine = (
    "import http.server, os, sys\\n"
    "with open(sys.argv[2], 'a') as pids: pids.write(f'{os.getpid()}\\\\n')\\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()\\n"
)
fleet._spawn("engine-0", [sys.executable, "-c", engine, str(port), str(work / "pids")], f"http://127.0.0.1:{port}/",
             {port: "engine-0"})
fleet._wait("engine-0")
fleet.processes["engine-0"].kill()


class Silent:
    def get(self, run_id):
        return Run(id=run_id)

    def follow(self, run_id, on_lost=None):
        threading.Event().wait(timeout=60)
        yield from ()


# stderr, where the fleet logs, is a pipe nobody reads (a paused pager): the next line logged blocks.
flags = fcntl.fcntl(2, fcntl.F_GETFL)
fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)
try:
    while True:
        os.write(2, b"." * 512)
except BlockingIOError:
    pass
fcntl.fcntl(2, fcntl.F_SETFL, flags)
try:
    with stop_on_signals(fleet) as received, raise_on_signals():  # as train_on_fleet holds them
        supervised_watch(fleet, Silent(), "run-1", RestartPolicy(first_backoff_s=0.1))
except StopSignal as stop:
    print(stop, flush=True)
finally:
    fleet.stop()
"""


def test_a_stop_signal_while_the_demo_restarts_a_service_stops_the_restarted_service(tmp_path: Path) -> None:
    """The signal raised in the demo's main thread wherever it was: inside the restart, after the service's new
    process had started but before the fleet had recorded it (its start logged to a stderr that blocked), the
    demo ended and left that process running, recorded nowhere."""
    pids = tmp_path / "pids"
    demo = subprocess.Popen(
        [sys.executable, "-c", RESTART_WITH_STDERR_FULL, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(engines) < 2:  # the first engine, then the restarted one
            assert demo.poll() is None, demo.communicate(timeout=10)
            assert time.monotonic() < deadline, "the engine was not restarted within 60 s"
            time.sleep(0.05)
            engines = [int(pid) for pid in pids.read_text().split()] if pids.exists() else []
        time.sleep(0.3)  # the demo is blocked logging that it started the engine
        os.kill(demo.pid, signal.SIGTERM)
        out, err = demo.communicate(timeout=60)  # reading stderr lets it go on
        assert "engine-0 exited with code -9; restarting it" in out, out + err.replace(".", "")[-2000:]
        assert out.endswith("SIGTERM: stopped\n"), out + err.replace(".", "")[-2000:]
        assert not process_runs(engines[1]), "the restarted engine outlived the demo"
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=10)
        for pid in engines:
            if process_runs(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_demo_whose_fleet_outlived_its_stop_says_so_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The demo said "5/5 fleet stopped" and exited 0 after a stop that left a service running."""
    from rlfleet.cli import demo

    def trained(fleet: SimpleNamespace, spec: object) -> tuple[Run, dict[int, float], list[float]]:
        fleet.left_running = ["rollout"]  # what LocalFleet.stop, called by train_on_fleet, says it left
        return Run(id="r", state=RunState.RUN_STATE_SUCCEEDED), {}, []

    def prepared(args: argparse.Namespace, spec: object, out: Path) -> SimpleNamespace:
        config = fleet_config(args, out)
        return SimpleNamespace(config=config, state_path=config.state_dir / "fleet.json", left_running=[])

    monkeypatch.setattr(demo, "prepare", prepared)
    monkeypatch.setattr(demo, "train_on_fleet", trained)
    out = tmp_path / "demo"
    assert demo.run_demo(demo_args("--out", str(out))) == 1
    printed = capsys.readouterr()
    assert "fleet stopped" not in printed.out
    assert "rollout still running" in printed.err and f"rlfleet down --state-dir {out / 'fleet'}" in printed.err
