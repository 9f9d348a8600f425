"""Fixtures of the deployment tests: where deploy/ lives, each service's settings class by name, and Redis servers
(loading, ready) for the probes that ask them."""

from __future__ import annotations

import os
import shutil
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def settings_classes() -> dict[str, type[BaseSettings]]:
    """Service name -> the pydantic-settings class its process reads RLFLEET_<SVC>_* variables into."""
    from rlfleet_engine.config import EngineConfig
    from rlfleet_reward.config import RewardSettings
    from rlfleet_rollout.config import RolloutConfig
    from rlfleet_router.config import RouterConfig
    from rlfleet_trainer.config import TrainerSettings

    return {
        "engine": EngineConfig,
        "router": RouterConfig,
        "reward": RewardSettings,
        "rollout": RolloutConfig,
        "trainer": TrainerSettings,
    }


@pytest.fixture
def redis_cli_at(tmp_path: Path) -> Callable[[int], dict[str, str]]:
    """An environment whose `redis-cli` (the probes name it without host or port) asks 127.0.0.1:`port`."""
    real = shutil.which("redis-cli")
    if real is None:
        pytest.skip("needs redis-cli")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "redis-cli").write_text(f'#!/bin/sh\nexec {real} -p "$REDIS_TEST_PORT" "$@"\n')
    (shim / "redis-cli").chmod(0o755)

    def env(port: int) -> dict[str, str]:
        return {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "REDIS_TEST_PORT": str(port)}

    return env


@pytest.fixture
def loading_redis() -> Iterator[int]:
    """The port of a server that answers every command as Redis does while it loads its AOF or RDB."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _LoadingReply)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def ready_redis(tmp_path: Path) -> Iterator[int]:
    """The port of a real redis-server that has loaded its data and answers PONG."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


class _LoadingReply(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        # RESP: an array header, then a length line and the data line per argument; answer once per command.
        while header := self.rfile.readline():
            if header.startswith(b"*"):
                for _ in range(int(header[1:]) * 2):
                    self.rfile.readline()
            self.wfile.write(b"-LOADING Redis is loading the dataset in memory\r\n")
            self.wfile.flush()
