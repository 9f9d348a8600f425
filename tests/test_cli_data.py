"""`rlfleet data arithmetic` in a pipeline: a reader that stops early (`| head -1`) ends it quietly, with the
status of a process a closed pipe stops (141), not a BrokenPipeError traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys


def arithmetic(*flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "data", "arithmetic", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_a_reader_that_takes_one_line_ends_the_output_quietly() -> None:
    data = arithmetic("--count", "100000", "--digits", "4")
    assert data.stdout is not None and data.stderr is not None
    first = json.loads(data.stdout.readline())
    data.stdout.close()
    err = data.stderr.read().decode()
    assert data.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert set(first) == {"prompt", "answer"}
    assert err == ""


def test_a_reader_gone_before_the_first_line_ends_the_output_quietly() -> None:
    """Three lines fit in the output buffer: the closed pipe shows only when it is flushed at the end."""
    data = arithmetic("--count", "3")
    assert data.stdout is not None and data.stderr is not None
    data.stdout.close()
    err = data.stderr.read().decode()
    assert data.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert err == ""


def test_an_output_that_cannot_be_written_is_one_line_not_a_traceback() -> None:
    """`> /dev/full` (a full disk) ended in an OSError traceback."""
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", "rlfleet.cli", "data", "arithmetic", "--count", "5000"],
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err == "rlfleet: error: [Errno 28] No space left on device\n"
