"""Fixtures of the router's tests: fake engines and a router, each served on loopback in a thread.

The router runs in-process here for speed; the e2e tests start it as a real process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from router_fakes import FakeEngine, RunningRouter, ThreadedServer  # noqa: E402

from rlfleet.processes import ServiceProcess  # noqa: E402
from rlfleet_router.config import RouterConfig  # noqa: E402
from rlfleet_router.http_app import create_app  # noqa: E402
from rlfleet_router.http_protocol import RouterHttpProtocol  # noqa: E402


@pytest.fixture
def start_process(tmp_path: Path) -> Iterator[Callable[[str, list[str]], ServiceProcess]]:
    """Starts real service processes (logs under tmp_path); stops them, last first, at teardown."""
    started: list[ServiceProcess] = []

    def start(name: str, argv: list[str]) -> ServiceProcess:
        process = ServiceProcess(name, argv, tmp_path / f"{name}.log", env={"RLFLEET_LOG_FORMAT": "text"})
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop(timeout=10)


@pytest.fixture
def start_engine() -> Iterator[Callable[..., FakeEngine]]:
    started: list[FakeEngine] = []

    def start(name: str, port: int | None = None, **attrs: object) -> FakeEngine:
        engine = FakeEngine(name=name, **attrs)  # type: ignore[arg-type]
        engine.server = ThreadedServer(engine.app(), port=port).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        assert engine.server is not None
        if engine.server._thread.is_alive():
            engine.server.stop()


@pytest.fixture
def start_router() -> Iterator[Callable[..., RunningRouter]]:
    started: list[RunningRouter] = []

    def start(worker_urls: list[str], **settings: object) -> RunningRouter:
        defaults: dict[str, object] = {
            "policy": "least_load",  # the tests of spreading and health expect it; cache_aware ones ask for it
            "health_check_interval_secs": 0.1,
            "health_check_timeout_secs": 2.0,
            "health_failure_threshold": 2,
            "health_success_threshold": 2,
            "request_timeout_secs": 20.0,
            "retry_initial_backoff_ms": 10,
        }
        config = RouterConfig(worker_urls=worker_urls, **{**defaults, **settings})  # type: ignore[arg-type]
        server = ThreadedServer(create_app(config), http=RouterHttpProtocol).start()  # as `python -m rlfleet_router`
        router = RunningRouter(server, httpx.Client(base_url=server.url, timeout=30.0, trust_env=False))
        started.append(router)
        return router

    yield start
    for router in started:
        router.client.close()
        router.server.stop()
