"""Engines and a router as real processes on loopback, for the weight sync test and bench/weight_sync.py."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlfleet.processes import ServiceProcess, free_port

START_TIMEOUT_S = 90.0
PROCESS_ENV = {"RLFLEET_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@dataclass
class EngineFleet:
    engine_urls: list[str]
    router_url: str
    engines: list[ServiceProcess]
    router: ServiceProcess

    def stop(self) -> None:
        self.router.stop()
        for engine in self.engines:
            # Short grace: an engine left waiting in a broken collective would hold its shutdown until the timeout.
            engine.stop(timeout=3.0)

    def restart_router(self) -> None:
        """Stops the router and starts it again on the same port: it knows nothing of the fleet's weights then."""
        self.router.stop()
        self.router = _restarted(self.router)
        self.router.wait_healthy(f"{self.router_url}/liveness", START_TIMEOUT_S)

    def restart_engine(self, i: int) -> None:
        """Stops engine `i` and starts it again on the same port, on its boot weights (version 0)."""
        self.engines[i].stop()
        self.engines[i] = _restarted(self.engines[i])
        self.engines[i].wait_healthy(f"{self.engine_urls[i]}/health", START_TIMEOUT_S)

    def generate(self, url: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{url}/generate", json=body, timeout=60.0)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_healthy_engines(self, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.router_url}/health", timeout=5.0)
            if response.status_code == 200 and response.json()["healthy"] == count:
                return
            time.sleep(0.1)
        raise AssertionError(f"the router did not report {count} healthy engines within {timeout_s}s")


def _restarted(process: ServiceProcess) -> ServiceProcess:
    return ServiceProcess(process.name, process.argv, process.log_path, env=PROCESS_ENV)


def start_engine_fleet(
    model_dir: Path, log_dir: Path, engines: int = 2, router_args: Sequence[str] = ()
) -> EngineFleet:
    """Starts `engines` CPU engines serving `model_dir` (weight version 0) and a router in front of them."""
    py = sys.executable
    ports = [free_port() for _ in range(engines)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    processes = [
        ServiceProcess(
            f"engine-{i}",
            [py, "-m", "rlfleet_engine", "--model-path", str(model_dir), "--port", str(port),
             "--torch-threads", "1", "--weight-version", "0"],
            log_dir / f"engine-{i}.log",
            env=PROCESS_ENV,
        )
        for i, port in enumerate(ports)
    ]  # fmt: skip
    router_port = free_port()
    router: ServiceProcess | None = None
    try:
        for process, url in zip(processes, urls, strict=True):
            process.wait_healthy(f"{url}/health", START_TIMEOUT_S)
        router = ServiceProcess(
            "router",
            [py, "-m", "rlfleet_router", "--worker-urls", *urls, "--port", str(router_port), *router_args],
            log_dir / "router.log",
            env=PROCESS_ENV,
        )
        fleet = EngineFleet(urls, f"http://127.0.0.1:{router_port}", processes, router)
        router.wait_healthy(f"{fleet.router_url}/liveness", START_TIMEOUT_S)
        fleet.wait_healthy_engines(engines)
    except BaseException:
        for process in [*processes, *([router] if router else [])]:
            process.stop()
        raise
    return fleet
