"""The signals that stop a command (Ctrl-C, SIGTERM, SIGHUP): outside a fleet's start they end the work in
progress at once, a child process included; during a fleet's start they only ask it to stop (a raise there
could leave a child started but unrecorded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlfleet.cli.stop_signals import StopSignal, raise_on_signals, stop_on_signals
from rlfleet.local_fleet import FleetConfig, LocalFleet
from rlfleet.process_identity import pid_alive


def signal_me_in(seconds: float, signum: int) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signum)).start()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_ends_a_child_process_and_the_work_waiting_on_it(tmp_path: Path, signum: int) -> None:
    pid_file = tmp_path / "pid"
    child = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(60)"
    before = signal.getsignal(signum)
    started = time.monotonic()
    with pytest.raises(StopSignal) as stopped, raise_on_signals():
        signal_me_in(2.0, signum)
        subprocess.run([sys.executable, "-c", child], timeout=60)
    assert stopped.value.signum == signum and time.monotonic() - started < 30
    assert not pid_alive(int(pid_file.read_text())), "the child outlived the command"
    assert signal.getsignal(signum) is before


def test_a_stop_signal_while_a_fleet_starts_asks_it_to_stop_and_raises_nothing(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fleet = LocalFleet(FleetConfig(model_path=model, state_dir=tmp_path / "state"))
    with raise_on_signals(), stop_on_signals(fleet) as received:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not fleet.stopping.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert received == [signal.SIGTERM]
