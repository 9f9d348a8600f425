"""What a program must not reach even where the platform gives no namespaces and an older Landlock: Unix sockets
on the host, signals to processes outside the sandbox, the hub's environment; and how much of stdout the hub reads."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet_reward import sandbox
from rlfleet_reward.sandbox import Isolation, SandboxLimits, probe_isolation, run_python

LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=5, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=8)
_PR_GET_DUMPABLE = 3


def _on_older_kernel(monkeypatch: pytest.MonkeyPatch) -> Isolation:
    """The shipped non-root setup on Linux 6.8: no namespaces (unshare refused), Landlock ABI 4 (no signal or
    abstract-socket scoping)."""
    source = sandbox._INIT_SOURCE
    assert "return max(0, version)" in source
    monkeypatch.setattr(sandbox, "_INIT_SOURCE", source.replace("return max(0, version)", "return min(4, version)"))
    probed = probe_isolation()
    return dataclasses.replace(probed, namespaces=False, landlock=min(4, probed.landlock))


@pytest.fixture(params=["as probed", "without namespaces", "on an older kernel"])
def isolation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Isolation:
    probed = probe_isolation()
    if request.param == "without namespaces":
        return dataclasses.replace(probed, namespaces=False)
    if request.param == "on an older kernel":
        return _on_older_kernel(monkeypatch)
    return probed


@pytest.fixture
def older_kernel(monkeypatch: pytest.MonkeyPatch) -> Isolation:
    return _on_older_kernel(monkeypatch)


def _sandbox_ids(isolation: Isolation) -> tuple[int, int]:
    return isolation.run_as or (os.getuid(), os.getgid())


@pytest.fixture
def victim(older_kernel: Isolation) -> Iterator[subprocess.Popen[bytes]]:
    """A process of the sandbox's own user, outside the sandbox."""
    uid, gid = _sandbox_ids(older_kernel)
    kwargs = {"user": uid, "group": gid, "extra_groups": []} if older_kernel.run_as else {}
    process = subprocess.Popen(["sleep", "60"], start_new_session=True, **kwargs)  # type: ignore[call-overload]
    try:
        yield process
    finally:
        process.kill()
        process.wait(5)


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_unix_sockets_on_the_host_are_refused(isolation: Isolation, abstract: bool) -> None:
    if not isolation.seccomp:
        pytest.skip("seccomp is not supported on this machine")
    # Where an agent's or a bus's socket would be: reachable by the sandbox's user, as far as permissions go.
    directory = Path(tempfile.mkdtemp(prefix="rlfleet-test-sockets-"))
    directory.chmod(0o777)
    address = f"\0rlfleet-test-{uuid.uuid4().hex}" if abstract else str(directory / "host.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    if not abstract:
        os.chmod(address, 0o777)  # only the sandbox, not file permissions, may refuse the connection
    listener.listen(1)
    program = (
        "import socket, sys\n"
        "try:\n"
        "    client = socket.socket(socket.AF_UNIX)\n"
        f"    client.connect({address!r}); client.sendall(b'hello'); print('connected')\n"
        "except OSError as exc:\n"
        "    print('refused')\n"
        "a, b = socket.socketpair()\n"  # stays allowed: asyncio and multiprocessing use it
        "a.sendall(b'x'); print(b.recv(1))\n"
    )
    result = run_python(program, "", LIMITS, isolation)
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    shutil.rmtree(directory)
    assert result.stdout.split() == ["refused", "b'x'"], result.stderr


def test_signals_reach_only_the_sandbox_without_pid_namespace_or_landlock_scoping(
    older_kernel: Isolation, victim: subprocess.Popen[bytes]
) -> None:
    if not older_kernel.seccomp:
        pytest.skip("seccomp is not supported on this machine")
    program = (
        "import fcntl, os, signal, threading\n"
        "def attempt(name, call):\n"
        "    try:\n"
        "        call(); print(name, 'allowed')\n"
        "    except OSError as exc:\n"
        "        print(name, type(exc).__name__)\n"
        f"attempt('victim', lambda: os.kill({victim.pid}, signal.SIGKILL))\n"
        "attempt('everyone', lambda: os.kill(-1, 0))\n"
        f"attempt('group', lambda: os.killpg({victim.pid}, 0))\n"
        # SIGIO's route: I/O on a file it owns signals the owner, whose default action for SIGIO is to die.
        f"attempt('sigio owner', lambda: fcntl.fcntl(os.pipe()[0], fcntl.F_SETOWN, {victim.pid}))\n"
        # What stays: signals to itself (os.kill, raise_signal, pthread_kill) and to its own process group.
        "received = []\n"
        "signal.signal(signal.SIGUSR1, lambda *_: received.append(1))\n"
        "attempt('self', lambda: os.kill(os.getpid(), signal.SIGUSR1))\n"
        "attempt('raise', lambda: signal.raise_signal(signal.SIGUSR1))\n"
        "attempt('thread', lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1))\n"
        "attempt('own group', lambda: os.killpg(0, 0))\n"
        "attempt('own group by id', lambda: os.killpg(os.getpgid(0), 0))\n"
        "print('received', len(received))\n"
    )
    result = run_python(program, "", LIMITS, older_kernel)
    assert result.stdout.splitlines() == [
        "victim PermissionError",
        "everyone PermissionError",
        "group PermissionError",
        "sigio owner PermissionError",
        "self allowed",
        "raise allowed",
        "thread allowed",
        "own group allowed",
        "own group by id allowed",
        "received 3",
    ], result.stderr
    assert victim.poll() is None


def test_describe_names_the_layers_of_this_kernel(older_kernel: Isolation) -> None:
    described = older_kernel.describe()
    assert "NO namespaces" in described
    if older_kernel.seccomp:
        assert "signals" in described.split("seccomp", 1)[1]


def test_the_hub_process_is_not_dumpable_so_its_environment_stays_unreadable() -> None:
    """Without Landlock (kernel < 5.13) a program of the hub's user could read /proc/<hub>/environ otherwise."""
    probe_isolation()
    assert ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 0


def test_stdout_is_read_only_up_to_the_asked_bytes(isolation: Isolation) -> None:
    limits = dataclasses.replace(LIMITS, file_size_bytes=8 << 20)
    huge = run_python("print('x' * (6 << 20))", "", limits, isolation, max_stdout_bytes=1000)
    assert (huge.exit_code, len(huge.stdout), huge.stdout_truncated) == (0, 1000, True), huge.stderr
    # Trailing whitespace past the bound changes no verdict, so it does not count as more output.
    padded = run_python("print('42' + ' ' * (4 << 20))\nprint()", "", limits, isolation, max_stdout_bytes=100)
    assert (padded.stdout.rstrip(), padded.stdout_truncated) == ("42", False), padded.stderr
    exact = run_python("print('42')", "", limits, isolation, max_stdout_bytes=3)
    assert (exact.stdout, exact.stdout_truncated) == ("42\n", False), exact.stderr


def test_the_hosts_shared_directories_are_empty_in_the_mount_namespace() -> None:
    probed = probe_isolation()
    if not probed.namespaces:
        pytest.skip("no namespaces on this machine")
    marker = Path(tempfile.gettempdir(), f"rlfleet-test-visible-{uuid.uuid4().hex}")
    marker.touch()
    program = (
        "import os\n"
        f"print(os.path.exists({str(marker)!r}), os.listdir('/dev/shm'))\n"
        "print([line.split()[1] for line in open('/proc/self/status') if line.startswith(('CapEff', 'CapAmb'))])\n"
        "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n"  # the working directory stays
    )
    try:
        # Without Landlock, which would refuse the reads before the mounts are seen.
        result = run_python(program, "", LIMITS, dataclasses.replace(probed, landlock=0))
    finally:
        marker.unlink()
    assert result.stdout.splitlines() == ["False []", "['0000000000000000', '0000000000000000']", "ok"], result.stderr


def test_a_program_that_stops_its_parent_still_dies_with_the_worker(isolation: Isolation) -> None:
    """Without a PID namespace the sandbox's first process kills the group when the worker dies; a program that
    stopped it (SIGSTOP to its parent, or to its whole group from a child, where only seccomp confines signals)
    outlived the worker, and its children with it, until someone killed them by hand."""
    marker = f"rlfleet-orphan-{uuid.uuid4().hex}"
    program = (
        "import os, signal, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "for target in (os.getppid(), 0):\n"  # 0: its own group, itself included
        "    try:\n"
        "        os.kill(target, signal.SIGSTOP)\n"
        "    except OSError:\n"
        "        pass\n"
        "time.sleep(60)\n"
    )
    limits = dataclasses.replace(LIMITS, wall_seconds=60, cpu_seconds=60)
    runner = multiprocessing.get_context("fork").Process(target=run_python, args=(program, "", limits, isolation))
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while not _processes_naming(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_naming(marker), "the program did not start"
        time.sleep(0.5)  # for its stop signals
    finally:
        runner.kill()  # as the hub kills a worker whose item overran
        runner.join(5)
    deadline = time.monotonic() + 5
    while (left := _processes_naming(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # the whole group, stopped members too, so that a failure leaves nothing running
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    assert not left


def _processes_naming(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and marker.encode() in Path(entry.path, "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(params=["with namespaces", "without namespaces"])
def without_landlock(request: pytest.FixtureRequest) -> Isolation:
    """A kernel before 5.13, or one whose `lsm=` leaves Landlock out; with namespaces or (unshare refused) without."""
    probed = probe_isolation()
    if request.param == "with namespaces" and not probed.namespaces:
        pytest.skip("no namespaces on this machine")
    return dataclasses.replace(probed, namespaces=request.param == "with namespaces", landlock=0)


def test_a_program_cannot_make_namespaces_of_its_own(without_landlock: Isolation) -> None:
    """Where the kernel allowed unprivileged user namespaces, a program made one, with a mount namespace, and mounted
    a tmpfs there: without Landlock (which refuses mounts) it held 400 MiB of files under a 256 MiB address-space
    limit and a 64 MiB disk bound, in pages no rlimit counts and in a directory the hub's watchdog, in another mount
    namespace, cannot see. Threads and child processes, which clone without namespace flags, still start."""
    if not without_landlock.seccomp:
        pytest.skip("seccomp is not supported on this machine")
    program = (
        "import ctypes, os, subprocess, sys, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x20000, 17\n"
        "CLONE = 56 if os.uname().machine == 'x86_64' else 220\n"
        "def attempt(name, result, forks):\n"
        "    if forks and result == 0:\n"
        "        os._exit(0)  # the child of a raw clone\n"
        "    print(name, 'allowed' if result >= 0 else os.strerror(ctypes.get_errno()))\n"
        "attempt('unshare', libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), False)\n"
        "attempt('clone', libc.syscall(CLONE, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), True)\n"
        "attempt('clone3', libc.syscall(435, ctypes.create_string_buffer(88), 88), True)\n"
        "thread = threading.Thread(target=print, args=('thread ran',)); thread.start(); thread.join()\n"
        "child = subprocess.run([sys.executable, '-c', 'print(\"child ran\")'], capture_output=True)\n"
        "print(child.stdout.decode().strip())\n"
    )
    result = run_python(program, "", LIMITS, without_landlock)
    assert result.stdout.splitlines() == [
        "unshare Operation not permitted",
        "clone Operation not permitted",
        "clone3 Function not implemented",  # so that glibc falls back to clone, whose flags the filter can read
        "thread ran",
        "child ran",
    ], result.stderr


def test_a_program_cannot_trace_or_write_the_sandboxs_first_process_without_landlock(
    without_landlock: Isolation,
) -> None:
    """Without a PID namespace that first process is the program's parent, of the same user and, until now,
    dumpable: where no Landlock domain stood between them, the program could stop it with PTRACE_ATTACH (so it never
    killed the group when the worker died) or write its memory through /proc (and, since it carries no signal
    filter, make it signal the hub)."""
    program = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "parent = os.getppid()\n"
        "attached = libc.ptrace(16, parent, None, None)  # PTRACE_ATTACH\n"
        "print('ptrace', 'allowed' if attached == 0 else os.strerror(ctypes.get_errno()))\n"
        "if attached == 0:\n"
        "    os.waitpid(parent, 0x40000000)  # __WALL\n"
        "    libc.ptrace(17, parent, None, None)  # PTRACE_DETACH, so that a failing run leaves it running\n"
        "for name in ('mem', 'environ'):\n"
        "    try:\n"
        "        open(f'/proc/{parent}/{name}', 'rb').close(); print(name, 'allowed')\n"
        "    except OSError as exc:\n"
        "        print(name, exc.strerror)\n"
    )
    result = run_python(program, "", LIMITS, without_landlock)
    assert result.stdout.splitlines() == [
        "ptrace Operation not permitted",
        "mem Permission denied",
        "environ Permission denied",
    ], result.stderr
