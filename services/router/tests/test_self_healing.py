"""The healer restarts an engine out of routing that keeps failing its probes, however it left routing, until it
passes a probe again (whatever its restarter raised meanwhile), and counts each restart by what came of it."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from router_fakes import FakeEngine, RelaunchingRestarter, RunningRouter, restarter_settings

from rlfleet_router import metrics as router_metrics
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import LeastLoad
from rlfleet_router.self_healing import Healer
from rlfleet_router.workers import Worker, WorkerRegistry


class FlakyRestarter:
    """Fails its first restart as `first` says (an error no restarter is documented to raise, or an answer that is
    not an engine's URL), then succeeds and lets the engine be admitted."""

    def __init__(self, workers: WorkerRegistry, first: str) -> None:
        self.calls = 0
        self._workers = workers
        self._first = first

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.calls += 1
        if self.calls == 1:
            if self._first == "raises":
                raise KeyError("model")  # e.g. a placeholder the command line does not fill in
            return self._first
        # The health checker's part, once the restart is done: back in routing.
        asyncio.get_running_loop().call_later(0.05, self._workers.admit, self._workers.get(url))
        return url

    async def release(self, url: str) -> None:
        pass

    async def close(self) -> None:
        pass


def fail_and_heal(workers: WorkerRegistry, worker: Worker, restarter: Any, metrics: RouterMetrics) -> None:
    """Fails `worker` once and lets a healer with `restarter` bring it back into routing (within 5 s) and end."""
    healer = Healer(restarter, workers, LeastLoad(), metrics, 5.0, initial_backoff_secs=0.01, max_backoff_secs=0.05)

    async def scenario() -> None:
        workers.on_failed = healer.on_failed
        workers.record_failure(worker, "connection refused")
        async with asyncio.timeout(5):
            while not worker.healthy or worker.restarting:  # the restart counted once it is back
                await asyncio.sleep(0.01)
        await healer.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("first", ["raises", "http://10.0.0.21:None"])
def test_an_unexpected_restart_error_is_retried_after_the_backoff(first: str) -> None:
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    restarter = FlakyRestarter(workers, first)
    metrics = RouterMetrics(workers, lambda: None)
    metrics.add_engine(worker.url)  # as the fleet does: counts for an engine the metrics do not have go nowhere
    fail_and_heal(workers, worker, restarter, metrics)
    assert restarter.calls == 2
    assert not worker.restarting and worker.restarts == 2
    failures = restarts(metrics, worker.url, "failure")
    assert failures == 1
    assert worker.last_error is None


class TimedRestarter:
    """Restarts at once, noting when; the engine comes back each time."""

    def __init__(self) -> None:
        self.times: list[float] = []

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.times.append(time.monotonic())
        return url

    async def release(self, url: str) -> None:
        pass

    async def close(self) -> None:
        pass


def test_an_engine_in_a_crash_loop_is_restarted_with_a_growing_backoff() -> None:
    """It comes back after each restart, passes a probe, then fails again (dying as it loads the fleet's weights).
    Before, each failure started a new restart at the first attempt, at once: 18 restarts in 3 s, 0.17 s apart."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    restarter = TimedRestarter()
    metrics = RouterMetrics(workers, lambda: None)
    healer = Healer(restarter, workers, LeastLoad(), metrics, 5.0, initial_backoff_secs=0.2, max_backoff_secs=0.8)
    workers.on_failed = healer.on_failed

    async def scenario() -> None:
        workers.record_failure(worker, "connection refused")
        end = time.monotonic() + 2.5
        seen = 0
        while time.monotonic() < end:
            await asyncio.sleep(0.01)
            if len(restarter.times) > seen:
                seen = len(restarter.times)
                workers.record_success(worker)  # back: it passes a probe ...
                await asyncio.sleep(0.05)
                workers.record_failure(worker, "connection refused")  # ... and dies again
        await healer.stop()

    asyncio.run(scenario())
    gaps = [b - a for a, b in itertools.pairwise(restarter.times)]
    assert 3 <= len(restarter.times) <= 5, gaps  # waits of 0.2, 0.4, 0.8, 0.8 s between restarts
    assert all(later > earlier for earlier, later in itertools.pairwise(gaps[:2])), gaps
    assert gaps[0] >= 0.2, gaps


def test_a_restarted_engine_loading_the_fleets_weights_is_not_restarted_again() -> None:
    """The restart timeout bounds the engine coming back, not the load of a large checkpoint after it."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    restarter = TimedRestarter()
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
            while not restarter.times:
                await asyncio.sleep(0.01)
            loading = True  # the admission's load: five restart timeouts long
            await asyncio.sleep(1.0)
            loading = False
            workers.admit(worker)
            while worker.restarting:
                await asyncio.sleep(0.01)
        await healer.stop()

    asyncio.run(scenario())
    assert len(restarter.times) == 1


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

    async def release(self, url: str) -> None:
        pass

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


class CountingRestarter:
    """Restarts at once; from restart number `passes_from` on, the engine then passes a probe (the health checker's
    part, without admitting it: admission may hold it back)."""

    def __init__(self, workers: WorkerRegistry, passes_from: int = 1) -> None:
        self.urls: list[str] = []
        self._workers = workers
        self._passes_from = passes_from

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.urls.append(url)
        if len(self.urls) >= self._passes_from:
            asyncio.get_running_loop().call_later(0.05, self._workers.record_success, self._workers.get(url))
        return url

    async def release(self, url: str) -> None:
        pass

    async def close(self) -> None:
        pass


def healer(workers: WorkerRegistry, restarter: Any, metrics: RouterMetrics, timeout: float = 5.0) -> Healer:
    return Healer(restarter, workers, LeastLoad(), metrics, timeout, initial_backoff_secs=0.3, max_backoff_secs=0.3)


def restarts(metrics: RouterMetrics, url: str, result: str) -> float | None:
    return metrics.registry.get_sample_value("rlfleet_router_engine_restarts_total", {"engine": url, "result": result})


def test_an_engine_out_of_routing_is_restarted_once_its_probes_keep_failing_however_it_left() -> None:
    """Taken out by a failed weight load, a broken group or version drift, or never up since it joined: none of
    these crossed the failure threshold in routing, and such an engine used to be left out for good."""
    workers = WorkerRegistry(failure_threshold=2, success_threshold=1)
    taken_out, _ = workers.add("http://127.0.0.1:9")
    workers.admit(taken_out)
    never_up, _ = workers.add("http://127.0.0.1:10")
    metrics = RouterMetrics(workers, lambda: None)
    for worker in (taken_out, never_up):
        metrics.add_engine(worker.url)
    restarter = CountingRestarter(workers)

    async def scenario() -> None:
        healing = healer(workers, restarter, metrics, timeout=0.2)
        await asyncio.sleep(0.3)  # longer than a restarted engine is given to come up
        booting, _ = workers.add("http://127.0.0.1:11")  # may be loading its model: given as long as a restart
        metrics.add_engine(booting.url)
        workers.on_failed = healing.on_failed
        workers.take_out(taken_out, "failed to load weight version '1': connection refused")
        for worker in (taken_out, never_up, booting):
            for _ in range(2):
                workers.record_failure(worker, "/health_generate: ConnectError")
        async with asyncio.timeout(5):
            while taken_out.restarting or never_up.restarting or len(restarter.urls) < 2:
                await asyncio.sleep(0.01)
        await healing.stop()

    asyncio.run(scenario())
    assert sorted(restarter.urls) == sorted([taken_out.url, never_up.url])
    assert restarts(metrics, taken_out.url, "success") == 1


def test_failures_of_a_removed_engine_start_no_restart_task() -> None:
    """A request at an engine removed from the fleet can lose its connection, which counts as a failure of that
    engine: each such engine kept a finished restart task for good, as pods came and went."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    removed, _ = workers.add("http://127.0.0.1:9")
    workers.admit(removed)
    metrics = RouterMetrics(workers, lambda: None)
    restarter = CountingRestarter(workers)

    async def scenario() -> dict[str, object]:
        healing = healer(workers, restarter, metrics)
        workers.on_failed = healing.on_failed
        workers.remove(removed.id)
        healing.forget(removed)
        workers.record_failure(removed, "/generate: ReadError")
        await asyncio.sleep(0.05)
        tasks = dict(healing._tasks)
        await healing.stop()
        return tasks

    assert asyncio.run(scenario()) == {} and restarter.urls == []


def test_a_restart_succeeds_once_the_engine_passes_a_probe_and_reads_restarting_until_then() -> None:
    """Counted as a success when the restarter returned, the first restart hid an engine that never came back; the
    backoff read as unhealthy. An engine that passed a probe is not restarted again, in routing or not (admission
    may hold it back, e.g. for a disk copy of the fleet's version: a restart would not change that)."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    metrics = RouterMetrics(workers, lambda: None)
    metrics.add_engine(worker.url)
    restarter = CountingRestarter(workers, passes_from=2)
    states: list[str] = []

    async def scenario() -> None:
        healing = healer(workers, restarter, metrics, timeout=0.2)
        workers.on_failed = healing.on_failed
        workers.record_failure(worker, "connection refused")
        async with asyncio.timeout(5):
            while len(restarter.urls) < 2:
                await asyncio.sleep(0.02)
                states.append("restarting" if worker.restarting else worker.state.value)
            while worker.restarting:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # longer than the restart timeout and the backoff: no third restart
        await healing.stop()

    asyncio.run(scenario())
    assert restarter.urls == [worker.url] * 2
    assert set(states) == {"restarting"}, "the attempt that failed and the backoff after it read as restarting"
    assert restarts(metrics, worker.url, "failure") == 1 and restarts(metrics, worker.url, "success") == 1
    assert not worker.healthy and not worker.restarting and worker.restarts == 2


def test_an_engine_restarted_at_the_url_of_another_worker_is_that_worker() -> None:
    """Discovery may add a replacement pod (by IP) before the restarter sees it Ready: the restarted worker leaves
    the fleet rather than be a second worker at that URL."""
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = workers.add("http://127.0.0.1:9")
    workers.admit(worker)
    discovered, _ = workers.add("http://127.0.0.1:10")
    metrics = RouterMetrics(workers, lambda: None)

    async def scenario() -> None:
        healing = healer(workers, MovingRestarter(workers), metrics)
        workers.on_failed = healing.on_failed
        workers.record_failure(worker, "connection refused")
        async with asyncio.timeout(5):
            while workers.contains(worker):
                await asyncio.sleep(0.01)
        await healing.stop()

    asyncio.run(scenario())
    assert workers.all() == [discovered] and worker.url == "http://127.0.0.1:9"
    assert workers.move(discovered, "http://127.0.0.1:10/") is None, "moving a worker to its own URL is no clash"


def test_an_engine_removed_while_it_is_restarted_is_restarted_no_more_and_counted_no_more(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELETE /workers used to leave the restart running: the local restarter then started an engine on the removed
    worker's port, unknown to the fleet, and its restart was counted under a series the removal had dropped."""
    steady, victim = start_engine("steady"), start_engine("victim")
    restarter = RelaunchingRestarter()
    restarter.gate = threading.Event()  # the restart takes its time (an adopted engine that still holds its port)
    router = start_router([steady.url, victim.url], **restarter_settings(monkeypatch, restarter))
    router.wait_healthy(2)
    victim.healthy = False
    router.wait_for(lambda: any(w["restarting"] for w in router.workers()), what="the victim being restarted")

    assert router.client.delete(f"/workers/{victim.url}").status_code == 200
    router.wait_for(lambda: restarter.released == [victim.url], what="what the restart started stopped")
    restarter.gate.set()
    time.sleep(0.5)
    assert restarter.restarts == [victim.url]
    assert f'engine="{victim.url}"' not in router.client.get("/metrics").text
