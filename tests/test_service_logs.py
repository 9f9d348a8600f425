"""A service's log file: moved aside when the service starts on a long one, so a fleet's logs stay bounded across
restarts and every start's lines are kept; its tail (in start errors) is read from the end, whatever its length."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rlfleet import processes
from rlfleet.processes import ServiceProcess

SAYS = [sys.executable, "-c", "print('started again', flush=True)"]


def run(log: Path) -> None:
    process = ServiceProcess("echo", SAYS, log)
    deadline = time.monotonic() + 10
    while process.alive():
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.02)
    process.stop(timeout=5)


def test_a_log_past_the_bound_is_moved_aside_when_its_service_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "LOG_KEEP_BYTES", 1000)
    log = tmp_path / "router.log"
    log.write_text("first\n" * 100)  # 600 bytes: under the bound, appended to
    run(log)
    assert log.read_text() == "first\n" * 100 + "started again\n"
    log.write_text("second\n" * 200)  # 1400 bytes: moved aside
    run(log)
    assert log.read_text() == "started again\n"
    assert (tmp_path / "router.log.1").read_text() == "second\n" * 200
    log.write_text("third\n" * 200)  # the next one past the bound replaces the one aside
    run(log)
    assert (tmp_path / "router.log.1").read_text() == "third\n" * 200
    assert sorted(path.name for path in tmp_path.iterdir()) == ["router.log", "router.log.1"]


def test_the_tail_is_the_last_whole_lines_of_a_log_longer_than_what_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "TAIL_READ_BYTES", 100)
    log = tmp_path / "router.log"
    log.write_text("".join(f"line {n:04d} of the log\n" for n in range(10_000)))  # 22 bytes a line
    process = ServiceProcess("quiet", [sys.executable, "-c", "pass"], log)
    process.stop(timeout=5)
    assert process.log_tail(lines=3).splitlines() == [f"line {n:04d} of the log" for n in range(9997, 10_000)]
    # Fewer whole lines in the bytes read than asked for: those, without the partial first one.
    assert process.log_tail(lines=30).splitlines() == [f"line {n:04d} of the log" for n in range(9996, 10_000)]
    short = tmp_path / "short.log"
    short.write_text("only\nlines\n")
    process = ServiceProcess("quiet", [sys.executable, "-c", "pass"], short)
    process.stop(timeout=5)
    assert process.log_tail() == "only\nlines"
