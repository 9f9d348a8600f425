"""A service's log file: moved aside when the service starts on a long one, so a fleet's logs stay bounded across
restarts and every start's lines are kept; its tail (in start errors) is read from the end, whatever its length;
this process holds no handle on it, whether the service's stop is interrupted or it could not be started."""

from __future__ import annotations

import os
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


def handles_on(path: Path) -> list[int]:
    """This process's file descriptors open on `path`."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path.resolve()):
                fds.append(int(fd))
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return fds


def test_an_interrupted_stop_leaves_no_handle_on_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt (Ctrl-C) in stop's wait skipped the close at its end: the log stayed open in this process,
    one descriptor per service a fleet's interrupted stop went through."""
    log = tmp_path / "engine.log"
    process = ServiceProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], log)
    try:

        def interrupted(timeout: float | None = None) -> int:
            raise KeyboardInterrupt

        monkeypatch.setattr(process.proc, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            process.stop(timeout=5)
        assert handles_on(log) == []
    finally:
        monkeypatch.undo()
        process.stop(timeout=5)


def test_a_program_that_cannot_be_started_leaves_no_handle_on_its_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with pytest.raises(FileNotFoundError) as raised:  # held: its traceback keeps the half-made ServiceProcess
        ServiceProcess("missing", [str(tmp_path / "no-such-program")], log)
    assert handles_on(log) == [], raised.value
