"""The trainer's launcher is torchrun that stops without a traceback: a stopped trainer does not read as a crash."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from rlfleet.processes import ServiceProcess

pytestmark = pytest.mark.e2e

RANK = """
import signal, sys, time
def stop(*_):
    print("rank stopping", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("rank up", flush=True)
time.sleep(120)
"""


def test_sigterm_stops_the_ranks_and_exits_with_the_signals_code_without_a_traceback(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    argv = [sys.executable, "-m", "rlfleet_trainer.launcher", "--standalone", "--nproc_per_node=1", str(script)]
    job = ServiceProcess("launcher", argv, tmp_path / "launcher.log", env={"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while "rank up" not in job.log_tail():
            assert job.alive() and time.monotonic() < deadline, job.log_tail(40)
            time.sleep(0.1)
        os.kill(job.pid, signal.SIGTERM)
        assert job.proc.wait(timeout=60) == 128 + signal.SIGTERM, job.log_tail(40)
        log = job.log_tail(200)
        assert "rank stopping" in log and "torchrun stopped by SIGTERM: its ranks have ended" in log
        assert "Traceback" not in log
    finally:
        job.stop(timeout=10)
