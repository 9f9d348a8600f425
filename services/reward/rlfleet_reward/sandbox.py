"""Running untrusted Python in a throwaway directory under limits, and what this machine can enforce.

Always: a new session (its own process group) that the program cannot leave, killed as a whole on a
wall-clock timeout and after the program ends; CPU, memory (address space), file-size, process
and open-file limits; a disk bound on the working directory (bytes allocated and entries, with the files the
group holds open or mapped that no directory names), which a watchdog checks every `_DISK_POLL_SECONDS` while the
program runs and once after it, killing the group past it; when asked, a bound on the memory the group's processes
hold together (`group_memory_bytes`, see `sandbox_memory`), which the watchdog checks with the disk bound; a
scrubbed environment (PATH, LANG, HOME and TMPDIR only) and `python -I`;
a fresh working directory, deleted afterwards (or, when the hub killed the worker mid-run, by the next
run of another worker); seccomp refusing `socket()` (AF_UNIX too), memory outside the address-space limit
(`memfd_create`, `shmget`), namespaces of the program's own (a tmpfs there would hold memory nothing counts), and,
where neither a PID namespace nor Landlock ABI >= 6 does it, signals to processes outside the sandbox (see
`sandbox_init`). Importing this module
makes the process undumpable: its /proc/<pid>/environ and memory are then closed to its own user's
other processes, a sandboxed program among them where Landlock (which also hides /proc) is missing.
When the hub runs as root, the program runs as `nobody` instead: root ignores RLIMIT_NPROC, and an
unprivileged user cannot read root's files or processes.
Where the platform allows (probed once per process, see `probe_isolation`):
- namespaces (`unshare`: user, network, PID, IPC, mount): no network interface but a down loopback, only
  the sandbox's own processes visible, every process in the namespace killed when its first process ends,
  and empty read-only tmpfs over /tmp, /run, /dev/shm and the hub's HOME (but the working directory);
- Landlock: reads only under the interpreter's directories and /usr, /lib, /bin; writes only in
  the working directory; from ABI 4 (Linux 6.7) no TCP; from ABI 6 (Linux 6.12) no signals or abstract
  Unix sockets to processes outside the sandbox.
`python -m rlfleet_reward.sandbox` prints what this machine enforces.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import functools
import json
import math
import os
import platform
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rlfleet_reward import sandbox_init

# Passed with `-c`, so the sandbox user needs no access to the hub's files.
_INIT_SOURCE = Path(sandbox_init.__file__).read_text()
_INTERPRETERS = (sys.executable, "/usr/local/bin/python3", "/usr/bin/python3")
# --keep-caps: the sandbox's first process mounts over the host's shared directories, then drops the capabilities.
_NAMESPACE_FLAGS = (
    "--user", "--map-current-user", "--keep-caps", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc"
)  # fmt: skip
# Where the host keeps Unix sockets and other users' files; hidden under an empty tmpfs in the mount namespace.
_SHARED_DIRECTORIES = ("/tmp", "/run", "/var/run", "/dev/shm")
_PROBE_SECONDS = 10.0
# After SIGKILL the group is gone within milliseconds; this bounds the wait for stragglers.
_GROUP_KILL_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1
# stdout is read up to what the caller asks, at most the file-size limit, which bounds it anyway; stderr, searched
# for a MemoryError only, up to this.
_MAX_STDERR_BYTES = 1 << 20
_READ_CHUNK_BYTES = 1 << 16
_PR_SET_DUMPABLE = 4
# How the program starts, in place of `python -I main.py`: Python ignores SIGXFSZ at start-up, so a write past
# RLIMIT_FSIZE would be an OSError (EFBIG), ending the program as any exception does, or caught. With the default
# restored, the kernel ends the program with SIGXFSZ, which `code` counts as output_limit. The status a run that
# reaches the end of main.py exits with is read from _STATUS_FILE and the file deleted before main.py starts: it is
# in no file, argument or variable of the program's own, so reading its directory or its source does not reveal it.
_STATUS_FILE = ".exit-status"
_PROGRAM_START = f"""
import os, runpy, signal, sys
def _run():
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    del sys.argv[0]
    with open({_STATUS_FILE!r}) as status_file:
        status = int(status_file.read())
    os.unlink({_STATUS_FILE!r})
    runpy.run_path(os.path.abspath(sys.argv[0]), run_name="__main__")
    sys.exit(status)
_run()
"""
# A run's directory and streams are named `rlfleet-sandbox-<worker pid>-...`, so a run can tell a dead
# worker's leftovers from a live one's.
_PREFIX = "rlfleet-sandbox-"
# Processes of the sandbox itself inside a run's user namespace: `unshare` and sandbox_init.
_SANDBOX_PROCESSES = 2
# The limits the hub enforces itself rather than the kernel, left out of what `sandbox_init` sets.
_NOT_RLIMITS = frozenset({"wall_seconds", "disk_bytes", "disk_entries", "group_memory_bytes"})
# RLIMIT_FSIZE bounds each file, not how many: the disk watchdog sums what the working directory holds this often
# while the program runs. The wait on the program's exit has this timeout, so a run that ends sooner is not
# slowed; between two checks a program can pass the bound by what it writes in that time, no more.
_DISK_POLL_SECONDS = 0.05
# A check of thousands of entries takes milliseconds: the next one waits at least this many times as long, so the
# watchdog takes at most about a fifth of a core.
_DISK_CHECK_SPACING = 4
# A directory renamed or removed while a check reads it makes the check look again, this many times at most: a
# program that keeps moving its directories hides what they hold, so it counts as past the bound.
_DISK_CHECK_ATTEMPTS = 3
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float
    cpu_seconds: int
    memory_bytes: int
    file_size_bytes: int
    max_processes: int
    max_open_files: int = 64
    # What the working directory may hold: bytes allocated (st_blocks, so a sparse file counts what it uses, and
    # directories and links count too), and entries (files, directories, links), so that a check stays short.
    disk_bytes: int = 64 << 20
    disk_entries: int = 10_000
    # What the group's processes may hold together (the sum of their proportional set sizes), checked by the
    # watchdog with the disk bound; None: only each process's address space is bound. RLIMIT_AS binds one process,
    # so a program of many processes can hold `memory_bytes` in each: more than its worker's share of the hub's
    # memory (`sandbox_memory`).
    group_memory_bytes: int | None = None


_SELFTEST_LIMITS = SandboxLimits(
    wall_seconds=_PROBE_SECONDS, cpu_seconds=5, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=8
)


@dataclass(frozen=True)
class Isolation:
    """What the sandbox enforces here beyond the always-on limits."""

    run_as: tuple[int, int] | None  # (uid, gid) to drop to, when the hub is root
    python: str  # an interpreter the sandbox user may run
    namespaces: bool
    landlock: int  # the kernel's Landlock ABI, 0 without Landlock
    seccomp: bool

    @property
    def signals_confined_by_seccomp(self) -> bool:
        """Whether seccomp has to keep signals in: neither a PID namespace nor Landlock signal scoping does."""
        return self.seccomp and not self.namespaces and self.landlock < sandbox_init._FIRST_SIGNAL_SCOPING_ABI

    def describe(self) -> str:
        uid = self.run_as[0] if self.run_as else os.getuid()
        landlock = "NO Landlock (kernel lacks it)"
        if self.landlock:
            landlock = f"Landlock ABI {self.landlock}: filesystem rules"
            landlock += ", no TCP" if self.landlock >= 4 else ", NOT TCP (ABI < 4)"
            scoped = self.landlock >= sandbox_init._FIRST_SIGNAL_SCOPING_ABI
            landlock += ", signals and abstract sockets scoped" if scoped else ", NOT signals (ABI < 6)"
        seccomp = "NO seccomp (unsupported machine)"
        if self.seccomp:
            seccomp = "seccomp: socket() (AF_UNIX too), io_uring, setsid/setpgid, memfd_create/shmget"
            seccomp += ", namespaces (unshare/setns/clone) refused"
            seccomp += ", signals to other processes refused" if self.signals_confined_by_seccomp else ""
        elif not self.namespaces and self.landlock < sandbox_init._FIRST_SIGNAL_SCOPING_ABI:
            seccomp += ", signals to the hub's processes NOT stopped"
        layers = [
            f"runs {self.python} as uid {uid}",
            "network/PID/IPC/mount namespaces (host /tmp, /run, /dev/shm, HOME hidden)"
            if self.namespaces
            else "NO namespaces (unshare unavailable)",
            landlock,
            seccomp,
        ]
        return ", ".join(layers)


@dataclass(frozen=True)
class RunResult:
    exit_code: int  # the program's, or 128 + N when signal N ended it
    timed_out: bool  # killed at the wall-clock limit
    stdout: str  # up to the bytes asked for
    stderr: str
    seconds: float
    # The program wrote more than `stdout` holds, and not only whitespace: past what the caller's verdict reads.
    stdout_truncated: bool = False
    # The working directory held more than `disk_bytes` or `disk_entries`: the group was killed (if still running).
    disk_exceeded: bool = False
    # The group's processes held more than `group_memory_bytes` together: the group was killed.
    memory_exceeded: bool = False


def _unprivileged_ids() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _usable_by(path: str, ids: tuple[int, int] | None) -> bool:
    """Whether user `ids` (None: this process's) may execute `path`: search every directory, run the file."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        return False
    if ids is None:
        return os.access(resolved, os.X_OK)
    uid, gid = ids
    for node in [*reversed(resolved.parents), resolved]:
        info = node.stat()
        bits = stat.S_IXUSR if info.st_uid == uid else stat.S_IXGRP if info.st_gid == gid else stat.S_IXOTH
        if not info.st_mode & bits:
            return False
    return True


def _popen_ids(run_as: tuple[int, int] | None) -> dict[str, Any]:
    """Popen's arguments that drop to `run_as` (uid, gid) with no supplementary groups; none without it."""
    return {"user": run_as[0], "group": run_as[1], "extra_groups": []} if run_as else {}


def _die_with_parent() -> None:
    # Runs in the child between fork and exec; the worker calling us is single-threaded.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@functools.cache
def probe_isolation() -> Isolation:
    """What this machine enforces; probed once per process (a property of the machine, it does not change).

    Raises RuntimeError when even the always-on layers cannot run a trivial program.
    """
    run_as = _unprivileged_ids()
    unshare = shutil.which("unshare")
    namespaces = False
    if unshare is not None:
        try:
            probe = subprocess.run(
                [unshare, *_NAMESPACE_FLAGS, "true"],
                capture_output=True,
                timeout=_PROBE_SECONDS,
                check=False,
                **_popen_ids(run_as),
            )
            namespaces = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            namespaces = False
    libc = ctypes.CDLL(None, use_errno=True)
    landlock = sandbox_init.landlock_abi(libc) if sys.platform.startswith("linux") else 0
    seccomp = sandbox_init.seccomp_program(platform.machine()) is not None
    python = next((path for path in _INTERPRETERS if _usable_by(path, run_as)), None)
    if python is None:
        raise RuntimeError(f"no Python interpreter the sandbox user may run among {list(_INTERPRETERS)}")
    isolation = Isolation(run_as, str(Path(python).resolve()), namespaces, landlock, seccomp)
    # One real run, so that a platform refusing a layer fails here, loudly, not as every program's failure.
    selftest = run_python("print(6 * 7)", "", _SELFTEST_LIMITS, isolation)
    if selftest.stdout.strip() != "42":
        raise RuntimeError(f"the code sandbox does not work here ({isolation.describe()}): {selftest.stderr[-500:]}")
    return isolation


def _read_roots(python: str) -> list[str]:
    prefix = Path(python).parent.parent  # /usr/local for /usr/local/bin/python3.11
    roots = {str(prefix), "/usr", "/lib", "/lib64", "/bin"}
    return sorted(root for root in roots if os.path.exists(root))


def _hidden_directories(read_roots: list[str]) -> list[str]:
    """The shared directories and the hub's HOME, as real paths, but none holding a read root (the interpreter
    must stay reachable) and none inside another."""
    found: list[str] = []
    for path in (*_SHARED_DIRECTORIES, os.environ.get("HOME", "")):
        if not path or not os.path.isdir(path):
            continue
        real = os.path.realpath(path)
        overlaps = [other for other in [*found, *read_roots] if _within(real, other) or _within(other, real)]
        if real != "/" and not overlaps:
            found.append(real)
    return found


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def run_python(
    source: str,
    stdin: str,
    limits: SandboxLimits,
    isolation: Isolation,
    max_stdout_bytes: int | None = None,
    end_status: int = 0,
) -> RunResult:
    """Runs `source` as `main.py` in a fresh directory under `limits`; the directory is deleted afterwards. A run
    that reaches the end of main.py exits with `end_status`, which the program cannot read (_PROGRAM_START).

    stdout is read up to `max_stdout_bytes` (None: the file-size limit, which the program cannot pass anyway):
    a caller comparing it with an expected output passes that output's length and a margin, and a longer output
    comes back cut with `stdout_truncated`, without the hub ever holding all of it. Whitespace past the cut does
    not count as more (comparisons ignore trailing whitespace)."""
    _remove_leftovers()
    with tempfile.TemporaryDirectory(prefix=f"{_PREFIX}{os.getpid()}-") as workdir:
        work = Path(workdir)
        for name, text in {"main.py": source, _STATUS_FILE: str(end_status)}.items():
            (work / name).write_text(text)
        if isolation.run_as:
            for path in [work, *work.iterdir()]:
                os.chown(path, *isolation.run_as)
        process_limit = limits.max_processes
        if isolation.namespaces:
            # In the run's own user namespace RLIMIT_NPROC counts `unshare` and the sandbox's init as well: without
            # them the smallest limit a spec may ask (2) ran no program at all, and any other left it two fewer.
            process_limit += _SANDBOX_PROCESSES
        else:
            # RLIMIT_NPROC counts every task of the user, not only the sandbox's: add what it already runs.
            process_limit += _tasks_of(isolation.run_as[0] if isolation.run_as else os.getuid())
        rlimits = {key: int(value) for key, value in asdict(limits).items() if key not in _NOT_RLIMITS}
        config = {
            "limits": {**rlimits, "max_processes": process_limit},
            "landlock": bool(isolation.landlock),
            "seccomp": isolation.seccomp,
            "namespaces": isolation.namespaces,
            "read_roots": _read_roots(isolation.python),
            "hide": _hidden_directories(_read_roots(isolation.python)),
        }
        python = isolation.python
        program = [python, "-I", "-c", _PROGRAM_START, "main.py"]
        argv = [python, "-I", "-S", "-c", _INIT_SOURCE, json.dumps(config), *program]
        if isolation.namespaces:
            argv = [shutil.which("unshare") or "unshare", *_NAMESPACE_FLAGS, *argv]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        stdout_bytes = (
            limits.file_size_bytes if max_stdout_bytes is None else min(max_stdout_bytes, limits.file_size_bytes)
        )
        return _run(argv, work, env, stdin, limits, stdout_bytes, _popen_ids(isolation.run_as))


def _remove_leftovers() -> None:
    """Deletes the directories and streams of runs whose worker is gone: the hub SIGKILLs a worker whose item
    overran, and its `TemporaryDirectory` never cleans up, so without this every such kill would leave up to
    `file_size_mb` per file the program wrote in the temporary directory, for good."""
    for entry in os.scandir(tempfile.gettempdir()):
        owner = entry.name.removeprefix(_PREFIX).split("-", 1)[0]
        if entry.name.startswith(_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                Path(entry.path).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _run(
    argv: Sequence[str],
    work: Path,
    env: dict[str, str],
    stdin: str,
    limits: SandboxLimits,
    stdout_bytes: int,
    ids: Mapping[str, Any],
) -> RunResult:
    # The streams live beside the working directory, not in it: the program cannot replace them.
    streams = {name: work.parent / f"{work.name}.{name}" for name in ("stdin", "stdout", "stderr")}
    streams["stdin"].write_text(stdin)
    started = time.monotonic()
    try:
        with (
            open(streams["stdin"], "rb") as stdin_file,
            open(streams["stdout"], "wb") as stdout_file,
            open(streams["stderr"], "wb") as stderr_file,
        ):
            process = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdin=stdin_file,
                stdout=stdout_file,
                stderr=stderr_file,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_die_with_parent,
                **ids,
            )
        ending = _watch(process.pid, work, limits)
        # The leader is not reaped yet, so its pid (the group's id) cannot have been reused.
        _kill_group(process.pid)
        exit_code = process.wait(timeout=_GROUP_KILL_SECONDS)
        seconds = time.monotonic() - started
        # Once more with nothing left running, so a program that filled the directory and ended between two
        # checks is caught too (its directory is deleted anyway, but the verdict does not depend on timing).
        disk_exceeded = ending == "disk" or _past_disk_bound(work, limits, process.pid)
        exit_code = 128 - exit_code if exit_code < 0 else exit_code
        stdout, truncated = _read_prefix(streams["stdout"], stdout_bytes)
        stderr, _ = _read_prefix(streams["stderr"], _MAX_STDERR_BYTES)
        timed_out, memory_exceeded = ending == "timed_out", ending == "memory"
        return RunResult(exit_code, timed_out, stdout, stderr, seconds, truncated, disk_exceeded, memory_exceeded)
    finally:
        for path in streams.values():
            path.unlink(missing_ok=True)


def _watch(pid: int, work: Path, limits: SandboxLimits) -> Literal["exited", "timed_out", "disk", "memory"]:
    """Waits for `pid` to exit (it stays a zombie until waited for) until the wall-clock limit, checking the memory
    bound of the group (when it has one) and the disk bound between waits: how the wait ended."""
    deadline = time.monotonic() + limits.wall_seconds
    interval = _DISK_POLL_SECONDS
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(math.ceil(min(left, interval) * 1000)):
                return "exited"
            checked = time.monotonic()
            if limits.group_memory_bytes is not None and _group_memory(pid) > limits.group_memory_bytes:
                return "memory"
            if _past_disk_bound(work, limits, pid):
                return "disk"
            interval = max(_DISK_POLL_SECONDS, _DISK_CHECK_SPACING * (time.monotonic() - checked))
        return "exited" if poller.poll(0) else "timed_out"
    finally:
        os.close(pidfd)


def _group_memory(pgid: int) -> int:
    """Bytes the live processes of group `pgid` hold: the sum of their proportional set sizes (a page shared by n
    of them counts 1/n in each, as a forked child's copy-on-write pages should), or of their resident sizes where
    /proc/<pid>/smaps_rollup is closed to this process (a program run as another user by a hub without
    CAP_SYS_PTRACE), which counts shared pages in each process and so errs on the side of the bound."""
    held = 0
    for pid, state in _group_members(pgid):
        if state == "Z":
            continue
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                held += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:")) * 1024
            continue
        except (OSError, StopIteration, ValueError, IndexError):
            pass  # closed to us, or ended meanwhile
        try:
            held += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_BYTES
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return held


def _past_disk_bound(work: Path, limits: SandboxLimits, pgid: int) -> bool:
    """Whether `work`, with the files the processes of group `pgid` hold that no directory names, holds more than
    `limits.disk_bytes` or `limits.disk_entries`. Links are not followed; the check stops at the first bound passed,
    so it reads at most `disk_entries` entries however many there are."""
    held = _unnamed_held_bytes(pgid, limits)
    if held > limits.disk_bytes:
        return True
    for _ in range(_DISK_CHECK_ATTEMPTS):
        past = _past_disk_bound_once(work, limits, held)
        if past is not None:
            return past
    return True


def _unnamed_held_bytes(pgid: int, limits: SandboxLimits) -> int:
    """Bytes allocated to the regular files that the processes of group `pgid` hold open or mapped but that no
    directory names (unlinked while open, or opened with O_TMPFILE): the directory's sum misses them, and each
    process may hold `max_open_files` of them, each up to the file-size limit. A file mapped after its descriptor
    was closed counts the file-size limit when this process may not look it up (/proc/<pid>/map_files needs
    CAP_SYS_ADMIN)."""
    seen: set[tuple[int, int]] = set()
    used = 0
    for pid, state in _group_members(pgid):
        if state == "Z":
            continue
        paths = []
        for task in _listdir(f"/proc/{pid}/task"):  # a thread may hold a descriptor table of its own
            paths += [f"/proc/{pid}/task/{task}/fd/{fd}" for fd in _listdir(f"/proc/{pid}/task/{task}/fd")]
        for path in paths:
            with contextlib.suppress(OSError):  # closed or ended meanwhile
                used += _count_unnamed(os.stat(path), seen)
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped = [line.split(maxsplit=5) for line in maps if line.endswith(" (deleted)\n")]
        except OSError:
            mapped = []  # it ended
        for start_end, _, _, device, inode, _ in (fields for fields in mapped if len(fields) == 6):
            try:
                used += _count_unnamed(os.stat(f"/proc/{pid}/map_files/{start_end}"), seen)
            except FileNotFoundError:
                continue  # unmapped or ended meanwhile
            except OSError:
                major, minor = (int(part, 16) for part in device.split(":"))
                if (os.makedev(major, minor), int(inode)) not in seen:  # not held by a descriptor too
                    seen.add((os.makedev(major, minor), int(inode)))
                    used += limits.file_size_bytes  # the most the file can hold
    return used


def _count_unnamed(info: os.stat_result, seen: set[tuple[int, int]]) -> int:
    """The bytes allocated to a regular file that no directory names, the first time it is seen; else 0."""
    if not stat.S_ISREG(info.st_mode) or info.st_nlink or (info.st_dev, info.st_ino) in seen:
        return 0
    seen.add((info.st_dev, info.st_ino))
    return info.st_blocks * 512


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []  # the process or thread ended


def _past_disk_bound_once(work: Path, limits: SandboxLimits, used: int = 0) -> bool | None:
    """None when an entry went away (or a directory became a file) while being read; `used` is counted already."""
    entries, pending = 0, [str(work)]
    while pending:
        try:
            with os.scandir(pending.pop()) as listing:
                for entry in listing:
                    entries += 1
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
                    if entries > limits.disk_entries or used > limits.disk_bytes:
                        return True
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            return True  # a directory it cannot read (a path too long, no permission) hides what it holds
    return False


def _kill_group(pgid: int) -> None:
    deadline = time.monotonic() + _GROUP_KILL_SECONDS
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.005)
        if not _group_has_live_members(pgid):
            return


def _group_has_live_members(pgid: int) -> bool:
    return any(state != "Z" for _, state in _group_members(pgid))


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process in group `pgid`, zombies ("Z") too."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members.append((int(entry.name), fields[0]))
    return members


def _tasks_of(uid: int) -> int:
    """Threads of every process running as `uid`: what RLIMIT_NPROC counts against its limit.

    The real uid comes from `status`: an undumpable process's /proc directory (the hub's) can be owned by root."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uids = next(line for line in Path(entry.path, "status").read_text().splitlines() if line[:4] == "Uid:")
                if int(uids.split()[1]) == uid:
                    count += len(os.listdir(os.path.join(entry.path, "task")))
            except (OSError, StopIteration, IndexError, ValueError):
                continue
    return count


def _read_prefix(path: Path, max_bytes: int) -> tuple[str, bool]:
    """The first `max_bytes` of the file, and whether anything but whitespace follows them (read a chunk at a
    time, so a long tail costs no memory)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut at a boundary stays whole
    with open(path, "rb") as stream:
        text = decoder.decode(stream.read(max_bytes))
        while chunk := stream.read(_READ_CHUNK_BYTES):
            if decoder.decode(chunk).strip():
                return text, True
    return text + decoder.decode(b"", final=True), False


def _make_undumpable() -> None:
    # At import, not at the first run: the hub's fork server preloads this module, so its workers, forked from it,
    # are undumpable before any of them runs a program.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "cannot make the hub's process undumpable")


_make_undumpable()

if __name__ == "__main__":
    print(probe_isolation().describe())
