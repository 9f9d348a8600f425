"""One slow engine holds up no fleet weight update: admitting an engine reads its version within the probe
timeout and holds the fleet's weight lock only to decide, a removed engine's admission stops, and an update
that could not start before its caller left (or its queue deadline passed) is never applied later."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
from fastapi import Request, Response
from router_fakes import FakeEngine, RunningRouter, ThreadedServer

from rlfleet.errors import Unavailable
from rlfleet_router import weights
from rlfleet_router.fleet_pause import FleetPause
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.weight_admission import Admission
from rlfleet_router.weights import FleetWeights, WeightTarget
from rlfleet_router.workers import Worker, WorkerRegistry


def load(router: RunningRouter, version: str, timeout: float = 10.0) -> httpx.Response:
    body = {"model_path": f"/ckpt/{version}", "weight_version": version}
    return router.client.post("/update_weights_from_disk", json=body, timeout=timeout)


@pytest.fixture
def start_silent_info_engine() -> Iterator[Callable[[str], FakeEngine]]:
    """Engines that pass their probes but never answer /get_model_info."""
    started: list[ThreadedServer] = []
    release = threading.Event()

    def start(name: str) -> FakeEngine:
        engine = FakeEngine(name=name)
        app = engine.app()

        @app.middleware("http")
        async def hang(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            while request.url.path == "/get_model_info" and not release.is_set():
                await asyncio.sleep(0.05)
            return await call_next(request)

        engine.server = ThreadedServer(app).start()
        started.append(engine.server)
        return engine

    yield start
    release.set()
    for server in started:
        server.stop()


def test_an_engine_silent_on_model_info_blocks_no_weight_update(
    start_engine: Callable[..., FakeEngine],
    start_router: Callable[..., RunningRouter],
    start_silent_info_engine: Callable[[str], FakeEngine],
) -> None:
    good = start_engine("good")
    router = start_router([good.url], health_check_timeout_secs=0.5, weight_update_timeout_secs=600.0)
    router.wait_healthy(1)

    silent = start_silent_info_engine("silent")
    assert router.client.post("/workers", json={"url": silent.url}).status_code == 202
    time.sleep(0.2)  # its admission is waiting for /get_model_info
    start = time.monotonic()
    assert load(router, "1").status_code == 200
    assert time.monotonic() - start < 3, "the fleet update waited for another engine's admission"
    router.wait_for(
        lambda: "/get_model_info" in str(router.workers()[1]["last_error"]), what="the silent engine's admission failed"
    )
    assert router.workers()[1]["state"] == "pending" and "ReadTimeout" in str(router.workers()[1]["last_error"])

    # Removed while its admission waits: nothing waits for it either.
    assert router.client.delete(f"/workers/{silent.url}").status_code == 200
    start = time.monotonic()
    assert load(router, "2").status_code == 200
    assert time.monotonic() - start < 3
    assert good.weight_version == "2" and [w["url"] for w in router.workers()] == [good.url]


def test_a_fleet_update_runs_while_another_engine_loads_weights_to_rejoin(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    good = start_engine("good")
    router = start_router([good.url], weight_update_timeout_secs=600.0)
    router.wait_healthy(1)
    assert load(router, "1").status_code == 200

    slow = start_engine("slow", update_delay=30.0)
    assert router.client.post("/workers", json={"url": slow.url}).status_code == 202
    router.wait_for(lambda: len(slow.update_bodies) == 1, what="the slow engine loading version 1 to rejoin")
    start = time.monotonic()
    assert load(router, "2").status_code == 200
    assert time.monotonic() - start < 3, "the fleet update waited for another engine's load"
    assert [w["healthy"] for w in router.workers()] == [True, False]


async def no_rejoin(workers: list[Worker]) -> None:
    assert not workers, "no stranded engine here"


def test_a_removed_engine_stops_loading_weights_to_rejoin(start_engine: Callable[..., FakeEngine]) -> None:
    slow = start_engine("slow", update_delay=30.0)

    async def admit_then_remove() -> None:
        registry = WorkerRegistry(failure_threshold=2, success_threshold=2)
        worker, _ = registry.add(slow.url)
        async with httpx.AsyncClient(trust_env=False) as client:
            metrics = RouterMetrics(registry, lambda: None)
            fleet_weights = FleetWeights(
                client, registry, 600.0, metrics, lambda _: None, info_timeout_secs=2.0, rejoin=no_rejoin
            )
            pauses = FleetPause(client, fleet_weights.busy, timeout_secs=2.0)
            body = b'{"model_path": "/ckpt/1", "weight_version": "1"}'
            fleet_weights.set_target(WeightTarget(version="1", model_path="/ckpt/1", request_body=body))
            admission = asyncio.create_task(Admission(fleet_weights, registry, pauses).admit(worker))
            while not slow.update_bodies:
                await asyncio.sleep(0.02)
            registry.remove(worker.id)
            with pytest.raises(Unavailable, match="removed from the fleet"):
                await asyncio.wait_for(admission, timeout=2)

    asyncio.run(asyncio.wait_for(admit_then_remove(), timeout=10))


def test_an_update_whose_caller_left_before_it_started_is_never_applied(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    # Version 1 loads for 2 s: the waiting update looks for its caller every 0.2 s, and on a loaded machine (CI's
    # workers on two cores) the 1 s load it used to wait behind could end before the caller's leaving was seen.
    engines = [start_engine(name, update_delay=2.0) for name in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)

    first = threading.Thread(target=load, args=(router, "1"))
    first.start()
    time.sleep(0.3)  # version 1 is loading; version 2 queues behind it
    with pytest.raises(httpx.TimeoutException):
        load(router, "2", timeout=0.3)  # the caller gives up while it waits
    first.join(10)
    time.sleep(2.5)  # a queued update would have run and finished by now

    for engine in engines:
        assert [b["weight_version"] for b in engine.update_bodies] == ["1"]
    assert router.client.get("/weight_version").json()["weight_version"] == "1"


def test_an_update_that_cannot_start_within_its_queue_deadline_is_refused(
    start_engine: Callable[..., FakeEngine],
    start_router: Callable[..., RunningRouter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights, "FANOUT_QUEUE_DEADLINE_SECS", 0.3)
    engine = start_engine("a", update_delay=1.0)
    router = start_router([engine.url])
    router.wait_healthy(1)

    first = threading.Thread(target=load, args=(router, "1"))
    first.start()
    time.sleep(0.2)
    refused = load(router, "2")
    first.join(10)

    assert refused.status_code == 503, refused.text
    assert "waited" in refused.json()["error"]["message"] and "not applied" in refused.json()["error"]["message"]
    time.sleep(0.3)
    assert [b["weight_version"] for b in engine.update_bodies] == ["1"]
    assert router.client.get("/weight_version").json()["weight_version"] == "1"


def test_a_fleet_load_that_reaches_an_engine_while_admission_reads_its_version_is_what_is_recorded(
    start_engine: Callable[..., FakeEngine],
) -> None:
    """The engine reports version 0; before admission decides, a fleet load (a stranded engine's disk fallback)
    brings it to version 2. It enters routing recorded as serving 2, which it does, not as the 0 it reported."""
    engine = start_engine("a")

    async def admit() -> Worker:
        registry = WorkerRegistry(failure_threshold=2, success_threshold=2)
        worker, _ = registry.add(engine.url)
        async with httpx.AsyncClient(trust_env=False) as client:
            fleet_weights = FleetWeights(
                client,
                registry,
                600.0,
                RouterMetrics(registry, lambda: None),
                lambda _: None,
                info_timeout_secs=2.0,
                rejoin=no_rejoin,
            )
            body = b'{"model_path": "/ckpt/2", "weight_version": "2"}'
            target = WeightTarget(version="2", model_path="/ckpt/2", request_body=body)
            fleet_weights.set_target(target)
            read = fleet_weights.served_weights

            async def read_then_loaded(worker: Worker) -> weights.ServedWeights:
                served = await read(worker)
                engine.weight_version, engine.model_path = "2", "/ckpt/2"
                fleet_weights.record_served(worker, target, fleet_weights.loads)
                return served

            fleet_weights.served_weights = read_then_loaded  # type: ignore[method-assign]
            pauses = FleetPause(client, fleet_weights.busy, timeout_secs=2.0)
            await Admission(fleet_weights, registry, pauses).admit(worker)
            return worker

    worker = asyncio.run(asyncio.wait_for(admit(), timeout=10))
    assert (worker.weight_version, worker.model_path) == ("2", "/ckpt/2")
    assert worker.healthy and engine.update_bodies == [], "it holds the version: admitted without loading it again"


@pytest.mark.parametrize(
    ("error", "may_be_loading"),
    [
        (httpx.RemoteProtocolError("Server disconnected without sending a response."), True),
        (httpx.ReadError("connection reset"), True),
        (httpx.ReadTimeout("timed out"), True),
        (httpx.ConnectError("connection refused"), False),
        (httpx.ConnectTimeout("timed out"), False),
    ],
)
def test_a_load_whose_connection_was_lost_after_it_was_sent_may_still_be_loading(
    error: httpx.HTTPError, may_be_loading: bool
) -> None:
    """A connection lost while the engine loads (a proxy in between cutting it) says nothing of the load, which
    goes on: it counted as a clear failure, so an engine that then served the version was not taken as the fleet's."""

    def fail(request: httpx.Request) -> httpx.Response:
        raise error

    async def post() -> bool:
        registry = WorkerRegistry(failure_threshold=2, success_threshold=2)
        worker, _ = registry.add("http://127.0.0.1:9")
        async with httpx.AsyncClient(transport=httpx.MockTransport(fail)) as client:
            fleet_weights = FleetWeights(
                client, registry, 5.0, RouterMetrics(registry, lambda: None), lambda _: None, 2.0, no_rejoin
            )
            result = await fleet_weights.post_update(worker, "/update_weights_from_disk", b"{}")
        assert not result.success and result.status is None
        return not result.answered

    assert asyncio.run(post()) is may_be_loading
