"""The `local` restarter: engine processes on this machine, started from a command template.

`local_engine_command` is a command line with `{host}` and `{port}` placeholders, e.g.
`python -m rlfleet_engine --backend sim --model-path sim --host {host} --port {port}`. The router
starts `local_engine_count` engines from it when it starts (on free ports), and adopts the engines
of `worker_urls` (started by someone else). To restart an engine it stops the process it started
(SIGTERM, then SIGKILL of the process group), or for an adopted engine waits until its port is
free, then starts the command again on the same host and port; the new process is then its own.
An engine that leaves the fleet (`DELETE /workers`, or removed while its restart was under way, which then starts
nothing more) is released: `release` stops the process started for it, so no engine the router started outlives its
worker (the healer does not call it once a worker at the same URL joined again: the process is that worker's).
Processes are known by host and port, so an engine elsewhere at the same port is never taken for one of them. On
shutdown it stops every process it started.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from rlfleet.errors import Unavailable
from rlfleet.processes import ServiceProcess, free_port
from rlfleet_router.config import RouterConfig

logger = logging.getLogger(__name__)


class LocalRestarter:
    def __init__(
        self, command: str, count: int, host: str, log_dir: Path, timeout_secs: float, stop_timeout_secs: float
    ) -> None:
        if not command:
            raise ValueError(
                "the local restarter needs local_engine_command, e.g. "
                "'python -m rlfleet_engine --model-path DIR --host {host} --port {port}'"
            )
        self._command = command
        self._count = count
        self._host = host
        self._log_dir = log_dir
        self._timeout = timeout_secs
        self._stop_timeout = stop_timeout_secs
        self._processes: dict[tuple[str, int], ServiceProcess] = {}  # by host and port

    @classmethod
    def from_config(cls, config: RouterConfig) -> LocalRestarter:
        return cls(
            command=config.local_engine_command,
            count=config.local_engine_count,
            host=config.local_engine_host,
            log_dir=Path(config.local_engine_log_dir),
            timeout_secs=config.restart_timeout_secs,
            stop_timeout_secs=config.local_engine_stop_timeout_secs,
        )

    def pid(self, url: str) -> int | None:
        """The pid of the process this restarter started for the engine at `url`, if it runs one."""
        process = self._processes.get(_address(url))
        return process.pid if process is not None else None

    async def start(self) -> list[str]:
        urls = []
        for _ in range(self._count):
            port = free_port(self._host)
            await asyncio.to_thread(self._spawn, self._host, port)
            urls.append(f"http://{self._host}:{port}")
        return urls

    async def restart(self, url: str) -> str:
        parts = urlsplit(url)
        host, port = parts.hostname or self._host, parts.port
        if port is None:
            raise Unavailable(f"cannot restart {url} locally: the URL has no port")
        process = self._processes.pop((host, port), None)
        if process is not None:
            await asyncio.to_thread(process.stop, self._stop_timeout)
        await self._wait_port_free(host, port, url)
        spawn = asyncio.ensure_future(asyncio.to_thread(self._spawn, host, port))
        try:
            await asyncio.shield(spawn)
        except asyncio.CancelledError:
            await spawn  # the thread starts the process whatever happens here: it is recorded, for `release`
            raise
        return url

    async def release(self, url: str) -> None:
        process = self._processes.pop(_address(url), None)
        if process is not None:
            logger.info("stopping engine %s (pid %d): it left the fleet", url, process.pid)
            await asyncio.to_thread(process.stop, self._stop_timeout)

    async def close(self) -> None:
        processes, self._processes = list(self._processes.values()), {}
        await asyncio.gather(*(asyncio.to_thread(p.stop, self._stop_timeout) for p in processes))

    async def _wait_port_free(self, host: str, port: int, url: str) -> None:
        # An adopted engine that hangs instead of dying still holds its port, and only its owner can stop it.
        deadline = time.monotonic() + self._timeout
        # In a thread: a connect to a port whose process stopped accepting blocks until its timeout, and the event
        # loop (every request the router relays) must not stop with it.
        while await asyncio.to_thread(listening, host, port):
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"cannot restart {url}: port {port} is still in use by a process the router did not start; "
                    "stop it or remove the worker"
                )
            await asyncio.sleep(0.1)

    def _spawn(self, host: str, port: int) -> None:
        argv = shlex.split(self._command.format(host=host, port=port))
        process = ServiceProcess(f"engine-{port}", argv, self._log_dir / f"engine-{port}.log")
        self._processes[(host.lower(), port)] = process
        logger.info("started engine %s (pid %d)", f"http://{host}:{port}", process.pid)


def _address(url: str) -> tuple[str, int]:
    """The host and port of `url` (port -1 without one: no process is started for such a URL)."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port if parts.port is not None else -1


def listening(host: str, port: int) -> bool:
    """Whether a process listens on host:port (a port in TIME_WAIT is free to a server). A connect that times out
    counts as one: a free port refuses at once, while a hung engine whose accept queue is full leaves the connect
    unanswered and still holds the port, where a process started now could not listen."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except TimeoutError:
        return True
    except OSError:
        return False


def create(config: RouterConfig) -> LocalRestarter:
    return LocalRestarter.from_config(config)
