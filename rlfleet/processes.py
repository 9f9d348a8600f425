"""Child processes of the fleet: start with a log file, wait until healthy (bounded), stop by pid.

Used by the local launcher (`rlfleet up`) and by the e2e tests, so both start services the same
way and neither can hang: every wait has a deadline, and stopping escalates from SIGTERM to
SIGKILL of the whole process group, whose every process must be gone (a service's helpers, such as
multiprocessing's forkserver, can outlive it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import httpx

from rlfleet.port_owner import descends_from, listening_sockets

logger = logging.getLogger(__name__)


class ServiceStartError(RuntimeError):
    """A service did not start: it exited, never became healthy, or its port belongs to another process."""


class StartInterrupted(RuntimeError):
    """Waiting for a service was given up because a stop was requested (Ctrl-C, `rlfleet down`)."""


LOG_KEEP_BYTES = 64 * 1024 * 1024
"""A service's log longer than this when the service (re)starts is moved to <log>.1, replacing the one there: a
fleet's logs take at most about twice this per service across restarts, the last run's lines always kept."""

TAIL_READ_BYTES = 64 * 1024
"""How much of a log's end `log_tail` reads: enough for its lines, however long the log is."""

PROGRESS_EVERY_S = 10.0
"""How often a wait for a service to be healthy says that it still waits (an engine loading a large model, the
trainer importing torch: a start that said nothing for minutes looked hung)."""
_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICKED_PORT = 15000
"""Ports below this stay for services with well-known defaults (Redis 6379, PostgreSQL 5432, 8000s)."""
_handed_out: set[int] = set()
_pick = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default when it cannot be read)."""
    try:
        low, high = _PORT_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _candidate_ports() -> range:
    """Where free ports are picked: outside the ephemeral range, so that no outgoing connection can be
    given the port between picking it and the service binding it (minutes later, in a fleet)."""
    low, high = _ephemeral_range()
    below = range(_LOWEST_PICKED_PORT, low)
    above = range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` now. The probe sets SO_REUSEADDR as the servers do (uvicorn, gRPC,
    Redis), so connections of a stopped server lingering in TIME_WAIT do not make its port look taken; a
    listening socket does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port p such that p .. p + count - 1 are all free now and none was handed out before by this
    process. Picked outside the kernel's ephemeral range when it leaves room (see _candidate_ports),
    else by binding port 0."""
    candidates = _candidate_ports()
    for _ in range(attempts):
        if len(candidates) >= 1000:
            base = _pick.randrange(candidates.start, candidates.stop - count + 1)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                base = int(sock.getsockname()[1])
        block = range(base, base + count)
        if block.stop <= 65536 and not _handed_out.intersection(block) and all(port_is_free(p, host) for p in block):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"found no {count} consecutive free ports on {host} in {attempts} attempts")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, never handed out before by this process (see free_port_block)."""
    return free_port_block(1, host)


def _states() -> Iterator[tuple[int, str, int]]:
    """(pid, state, process group) of every process, from Linux's /proc."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            yield int(entry.name), fields[0], int(fields[2])


def process_runs(pid: int) -> bool:
    """Whether process `pid` runs: exists and is not a zombie (exited, not yet collected by its parent)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc to tell a zombie by
        return _signal_reaches(lambda: os.kill(pid, 0))
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def group_runs(pgid: int) -> bool:
    """Whether any process of process group `pgid` runs (zombies apart)."""
    if not Path("/proc/self").is_dir():
        return _signal_reaches(lambda: os.killpg(pgid, 0))
    return any(group == pgid and state not in ("Z", "X") for _, state, group in _states())


def send_stop(pid: int) -> bool:
    """SIGTERM to service `pid` alone, as `docker stop` and Kubernetes send it: the service stops the helpers it
    started (a signal to its whole group ended the reward hub's fork server and workers mid-item, before the hub
    could let its requests finish). To its process group when the service is gone but helpers of it are left.
    False when neither runs. The SIGKILL that follows once a stop bound has passed goes to the whole group."""
    for send in (os.kill, os.killpg):
        try:
            send(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        return True
    return False


def _signal_reaches(send: Callable[[], None]) -> bool:
    try:
        send()
    except ProcessLookupError:
        return False
    except PermissionError:  # there, another user's
        return True
    return True


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def killed_with_parent() -> Callable[[], None]:
    """A `preexec_fn` that has the child killed (SIGKILL) when this process dies, however it dies: a step that
    outlived a SIGKILLed `rlfleet demo` ran on for up to half an hour, where no `rlfleet down` could see it.
    Linux only; elsewhere it does nothing."""
    parent = os.getpid()

    def arrange() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # it died before the line above could arrange it
                os._exit(1)

    return arrange


def command_line(*head: str, **flags: object) -> list[str]:
    """`head`, then `--name value` for each keyword in order: underscores in a name become dashes, a list
    or tuple gives its items after the flag, any other value its `str` (as `--name=value` when it starts with
    '-', which argparse would take for a flag: arithmetic's operators `-+`)."""
    argv = list(head)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif str(value).startswith("-"):
            argv.append(f"{flag}={value}")
        else:
            argv += [flag, str(value)]
    return argv


def rotate_log(log_path: Path) -> None:
    """Moves a log past LOG_KEEP_BYTES to <log>.1 before a process appends to it again."""
    try:
        if log_path.stat().st_size > LOG_KEEP_BYTES:
            os.replace(log_path, log_path.with_name(log_path.name + ".1"))
    except FileNotFoundError:
        pass


class ServiceProcess:
    """One child process in its own process group, logging to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(self.log_path)
        # Only the child writes the log, through its own copy of the descriptor: this process's handle is closed as
        # soon as the child has it. Held until stop(), it leaked when stop was interrupted (Ctrl-C in its wait),
        # when the program could not be started, and for a process never stopped.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        logger.info("started %s (pid %d), log %s", name, self.proc.pid, self.log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(0, size - TAIL_READ_BYTES))
                end = log.read()
        except OSError:
            return ""
        kept = end.splitlines()[-lines:] if size <= TAIL_READ_BYTES else end.splitlines()[1:][-lines:]
        return "\n".join(line.decode(errors="replace") for line in kept)

    def wait_healthy(
        self,
        url: str,
        timeout: float,
        port: int | None = None,
        stop: threading.Event | None = None,
        ports: Collection[int] = (),
    ) -> None:
        """Polls `url` until it answers 200 from this process; ServiceStartError (with the log tail) otherwise.

        An answer counts only while this process is alive and, given its `port`, only when this process (or a
        descendant) holds the socket listening there: another server on the port would otherwise pass for it.
        Of `ports` (every other port the service binds, such as its gRPC one), no socket listening there may
        belong to another process: gRPC servers share a port with SO_REUSEPORT without an error, and the other
        process would get part of the service's connections. StartInterrupted as soon as `stop` is set.
        """
        started = said = time.monotonic()
        deadline = started + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                raise StartInterrupted(f"stopped while waiting for {self.name} to be healthy")
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                logger.info(
                    "still waiting for %s to be healthy at %s (last try: %s; %.0f s of at most %.0f s; log %s)",
                    self.name,
                    url,
                    last,
                    time.monotonic() - started,
                    timeout,
                    self.log_path,
                )
                said = time.monotonic()
            if not self.alive():
                raise ServiceStartError(
                    f"{self.name} exited with code {self.proc.returncode} before it was healthy; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(url, timeout=2.0)
                if response.status_code == 200 and self.alive():
                    if port is not None:
                        self._check_listener(port)
                    for other in sorted(set(ports) - {port}):
                        self._check_listener(other, answered=False)
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.2)
        raise ServiceStartError(
            f"{self.name} was not healthy at {url} within {timeout:.0f}s ({last}); "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def _check_listener(self, port: int, answered: bool = True) -> None:
        """ServiceStartError when a socket listening on `port` belongs to another process than this one or its
        descendants, or (`answered`: the health check was answered there) when none of them listens there (where
        /proc tells; elsewhere the port checks made before the start stand alone)."""
        sockets = listening_sockets(port)
        if sockets is None:
            return
        ours = [any(descends_from(pid, self.pid) for pid in pids) for pids in sockets]
        if all(ours):
            return
        others = set().union(*(pids for pids, own in zip(sockets, ours, strict=True) if not own))
        owners = ", ".join(str(pid) for pid in sorted(others)) or "a process of another user"
        if any(ours):
            what = f"{owners} listens on port {port} beside {self.name} (pid {self.pid}) and would get part of its "
            what += "connections"
        elif answered:
            what = f"port {port} answers, but not from {self.name} (pid {self.pid}): {owners} listens there"
        else:
            what = f"port {port} of {self.name} (pid {self.pid}) is listened on by {owners}"
        raise ServiceStartError(
            f"{what}; stop it or choose other ports. Last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the service (`send_stop`), SIGKILL what is left of its process group (the service, and helpers
        it started, which can outlive it or a crash of it) after `timeout`; returns the exit code."""
        deadline = time.monotonic() + timeout
        # Its pid is its own until it is reaped: once it has been, the kernel may have given the number to another
        # process, and only its group (which keeps its id while a helper of it runs) is signalled.
        if self.proc.poll() is None:
            send_stop(self.pid)
        elif group_runs(self.pid):
            self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0fs; killing it", self.name, timeout)
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=10)
        while group_runs(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_runs(self.pid):
            logger.warning("processes %s started were left after it stopped; killing them", self.name)
            self._signal_group(signal.SIGKILL)
        return self.proc.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
