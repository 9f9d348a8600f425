"""The sandbox's layers one by one, with and without namespaces (the fallback where unshare is refused)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlfleet_reward.sandbox import Isolation, SandboxLimits, probe_isolation, run_python

LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=5, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=8)


@pytest.fixture(params=["as probed", "without namespaces"])
def isolation(request: pytest.FixtureRequest) -> Isolation:
    probed = probe_isolation()
    if request.param == "without namespaces":
        return dataclasses.replace(probed, namespaces=False)
    return probed


def test_sockets_and_leaving_the_process_group_are_refused(isolation: Isolation) -> None:
    if not isolation.seccomp:
        pytest.skip("seccomp is not supported on this machine")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    program = (
        "import os, socket\n"
        f"for attempt in (lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1), os.setsid):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('allowed')\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        "a, b = socket.socketpair()\n"  # AF_UNIX stays allowed
        "a.sendall(b'x'); print(b.recv(1))\n"
    )
    result = run_python(program, "", LIMITS, isolation)
    assert result.stdout.split() == ["PermissionError", "PermissionError", "b'x'"], result.stderr
    listener.close()


def test_memory_outside_the_address_space_limit_is_refused(isolation: Isolation) -> None:
    """A memfd's pages, never mapped, count against no RLIMIT_AS: 60 memfds of 16 MiB held 960 MiB under a
    64 MiB limit, and no file the disk bound sees holds them. System V shared memory is the same."""
    if not isolation.seccomp:
        pytest.skip("seccomp is not supported on this machine")
    program = (
        "import ctypes, os\n"
        "try:\n"
        "    fd = os.memfd_create('held')\n"
        "    os.posix_fallocate(fd, 0, 1 << 19)\n"
        "    print('memfd allowed')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0, 1 << 19, 0o1600), ctypes.get_errno() == 1)\n"  # IPC_PRIVATE, IPC_CREAT | 0600
    )
    result = run_python(program, "", LIMITS, isolation)
    assert result.stdout.split() == ["PermissionError", "-1", "True"], (result.stdout, result.stderr)


def test_environment_is_scrubbed_and_files_stay_in_the_working_directory(isolation: Isolation) -> None:
    program = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n"
        "try:\n"
        "    open('/tmp/rlfleet-sandbox-escape', 'w')\n"
        "    print('escaped')\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
    )
    result = run_python("import errno\n" + program, "", LIMITS, isolation)
    lines = result.stdout.splitlines()
    assert lines[:2] == ["['HOME', 'LANG', 'PATH', 'TMPDIR']", "ok"], result.stderr
    if isolation.landlock or isolation.namespaces:
        # Landlock refuses the write (EACCES); in a mount namespace /tmp is a read-only tmpfs first (EROFS).
        assert lines[2] == ("EROFS" if isolation.namespaces else "EACCES")


@pytest.mark.parametrize("target", ["open('big', 'w')", "sys.stdout"])
def test_a_write_past_the_file_size_limit_ends_the_program_with_sigxfsz(isolation: Isolation, target: str) -> None:
    # Python ignores SIGXFSZ at start-up: the write was an OSError, here caught and the exit status 0.
    program = f"import sys\ntry:\n    {target}.write('x' * (2 << 20))\nexcept OSError:\n    pass\n"
    result = run_python(program, "", LIMITS, isolation)
    assert result.exit_code == 128 + signal.SIGXFSZ, result.stderr


def test_stdout_is_read_whole_up_to_the_file_size_limit(isolation: Isolation) -> None:
    result = run_python("print('x' * (3 << 20))", "", dataclasses.replace(LIMITS, file_size_bytes=4 << 20), isolation)
    assert (result.exit_code, len(result.stdout)) == (0, (3 << 20) + 1), result.stderr


def test_the_wall_clock_limit_kills_the_whole_group(isolation: Isolation) -> None:
    # The child sleeps, so only the wall clock (not the CPU limit) can end it.
    program = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)\n"
    result = run_python(program, "", dataclasses.replace(LIMITS, wall_seconds=0.5), isolation)
    assert result.timed_out and result.seconds < 3


def test_a_worker_killed_mid_run_leaves_no_process_and_its_directory_goes_next_run(isolation: Isolation) -> None:
    """The hub SIGKILLs a worker whose item overran: nothing of that run may survive it."""
    marker = f"rlfleet-orphan-{uuid.uuid4().hex}"
    program = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "time.sleep(60)\n"
    )
    runner = multiprocessing.get_context("fork").Process(
        target=run_python, args=(program, "", dataclasses.replace(LIMITS, wall_seconds=60), isolation)
    )
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while not _processes_naming(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_naming(marker), "the program did not start"
        left = {
            path
            for path in Path(tempfile.gettempdir()).iterdir()
            if path.name.startswith(f"rlfleet-sandbox-{runner.pid}-")
        }
        assert left, "the run's directory is named for the worker"
    finally:
        runner.kill()
        runner.join(5)
    deadline = time.monotonic() + 5
    while _processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_naming(marker)
    run_python("pass", "", LIMITS, isolation)
    assert not any(path.exists() for path in left)


def _processes_naming(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and marker.encode() in Path(entry.path, "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
