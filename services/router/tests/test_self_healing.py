"""The healer keeps restarting an engine that is out of routing, whatever its restarter raised."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlfleet_router import metrics as router_metrics
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import LeastLoad
from rlfleet_router.self_healing import Healer
from rlfleet_router.workers import Worker, WorkerRegistry


class FlakyRestarter:
    """Raises an error no restarter is documented to raise, then succeeds and lets the engine be admitted."""

    def __init__(self, workers: WorkerRegistry) -> None:
        self.calls = 0
        self._workers = workers

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.calls += 1
        if self.calls == 1:
            raise KeyError("model")  # e.g. a placeholder the command line does not fill in
        self._workers.admit(self._workers.get(url))  # the health checker's part: back in routing
        return url

    async def close(self) -> None:
        pass


def fail_and_heal(workers: WorkerRegistry, worker: Worker, restarter: Any, metrics: RouterMetrics) -> None:
    """Fails `worker` once and lets a healer with `restarter` bring it back into routing (within 5 s)."""
    healer = Healer(restarter, workers, LeastLoad(), metrics, 5.0, initial_backoff_secs=0.01, max_backoff_secs=0.05)

    async def scenario() -> None:
        workers.on_failed = healer.on_failed
        workers.record_failure(worker, "connection refused")
        async with asyncio.timeout(5):
            while not worker.healthy:
                await asyncio.sleep(0.01)
        await healer.stop()

    asyncio.run(scenario())


def test_an_unexpected_restart_error_is_retried_after_the_backoff() -> None:
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    restarter = FlakyRestarter(workers)
    metrics = RouterMetrics(workers, lambda: None)
    fail_and_heal(workers, worker, restarter, metrics)
    assert restarter.calls == 2
    assert not worker.restarting and worker.restarts == 2
    failures = metrics.restarts.labels(engine=worker.url, result="failure")._value.get()
    assert failures == 1
    assert worker.last_error is None


class SlowLoadRestarter:
    """Restarts at once; the engine then spends longer than the restart timeout loading the fleet's weights."""

    def __init__(self) -> None:
        self.calls = 0

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.calls += 1
        return url

    async def close(self) -> None:
        pass


def test_a_restarted_engine_loading_the_fleets_weights_is_not_restarted_again() -> None:
    """The restart timeout bounds the engine coming back, not the load of a large checkpoint after it."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    restarter = SlowLoadRestarter()
    loading = False
    healer = Healer(
        restarter,
        workers,
        LeastLoad(),
        RouterMetrics(workers, lambda: None),
        0.2,
        initial_backoff_secs=0.01,
        max_backoff_secs=0.05,
        loading=lambda w: loading,
    )

    async def scenario() -> None:
        nonlocal loading
        workers.on_failed = healer.on_failed
        workers.record_failure(worker, "connection refused")
        async with asyncio.timeout(5):
            while not restarter.calls:
                await asyncio.sleep(0.01)
            loading = True  # the admission's load: five restart timeouts long
            await asyncio.sleep(1.0)
            loading = False
            workers.admit(worker)
            while worker.restarting:
                await asyncio.sleep(0.01)
        await healer.stop()

    asyncio.run(scenario())
    assert restarter.calls == 1


class MovingRestarter:
    """Restarts the engine at a new URL (a replacement pod) and lets it be admitted there."""

    def __init__(self, workers: WorkerRegistry) -> None:
        self._workers = workers

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        worker = self._workers.get(url)
        asyncio.get_running_loop().call_later(0.05, self._workers.admit, worker)
        return "http://127.0.0.1:10"

    async def close(self) -> None:
        pass


def test_an_engine_that_moved_keeps_its_former_series_only_until_they_can_be_scraped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every restart at a new pod IP used to leave the old URL's series for as long as the router ran; dropped at
    once, the restart counted under the old URL would never be scraped."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    metrics = RouterMetrics(workers, lambda: None)
    metrics.add_engine(worker.url)
    workers.admit(worker)
    fail_and_heal(workers, worker, MovingRestarter(workers), metrics)
    assert worker.url == "http://127.0.0.1:10"
    old = 'rlfleet_router_engine_restarts_total{engine="http://127.0.0.1:9",result="success"} 1.0'
    new = 'rlfleet_router_engine_restarts_total{engine="http://127.0.0.1:10",result="success"} 0.0'
    text = metrics.exposition().decode()
    assert old in text and new in text
    monkeypatch.setattr(router_metrics, "MOVED_ENGINE_SERIES_SECS", 0.0)
    metrics.engine_moved("http://127.0.0.1:9", worker.url)
    text = metrics.exposition().decode()
    assert 'engine="http://127.0.0.1:9"' not in text and new in text
