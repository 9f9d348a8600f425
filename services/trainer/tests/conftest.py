"""A recording stand-in for the router's weight and pause endpoints, served over real HTTP in a thread, and a
TrainerCore on it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from rlfleet.processes import free_port
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.trainer_core import TrainerCore


@dataclass
class FakeRouter:
    url: str
    loads: list[dict] = field(default_factory=list)
    disk_copies: list[dict] = field(default_factory=list)
    fail_next: int = 0
    """How many of the next weight calls (loads and disk copies alike) answer 503."""
    page_status: int | None = None
    """Answer loads with an HTML page of this HTTP status instead, as a proxy or a wrong URL would."""
    delay_s: float = 0.0
    """How long each load takes (a slow fleet): the step, or the StartRun, that asked waits that long."""
    loading: threading.Event = field(default_factory=threading.Event)
    """Set as a load request arrives."""
    calls: list[str] = field(default_factory=list)
    """The paths of the weight, pause and continue calls, in the order they arrived."""
    continue_answers: list[int] = field(default_factory=list)
    """HTTP statuses the next /continue_generation calls answer (then 200): 502 names ENGINE as failed."""
    engine_state: str = "healthy"
    """ENGINE's state in GET /workers."""
    pauses: list[dict] = field(default_factory=list)
    """The bodies of the /pause_generation calls."""
    partial_loads: list[str] = field(default_factory=list)
    """The fleet versions the next loads answer 502 with, as the router does once FAILED_ENGINE failed one: the
    version asked for when ENGINE loaded it (FAILED_ENGINE is taken out of routing), another when it did not."""
    disk_copy_conflict: bool = False
    """Refuse disk copies with 409, as a router that restarted since the broadcast (and knows no version) does."""


ENGINE = "http://127.0.0.1:30001"
"""The one engine behind the fake router."""
FAILED_ENGINE = "http://127.0.0.1:30002"
"""The engine that fails the loads `partial_loads` answers."""


@pytest.fixture
def fake_router() -> Iterator[FakeRouter]:
    port = free_port()
    router = FakeRouter(url=f"http://127.0.0.1:{port}")
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    async def load(request: Request) -> Response:
        router.calls.append(request.url.path)
        router.loading.set()
        await asyncio.sleep(router.delay_s)
        if router.page_status is not None:
            return HTMLResponse("<html><body>nginx</body></html>", status_code=router.page_status)
        if router.fail_next > 0:
            router.fail_next -= 1
            return JSONResponse({"success": False, "message": "engine down"}, status_code=503)
        if router.partial_loads:
            return await partial_load(await request.json(), router.partial_loads.pop(0))
        router.loads.append(await request.json())
        return JSONResponse({"success": True, "message": "ok"})

    async def partial_load(load: dict, served: str) -> JSONResponse:
        """The router's answer (`FleetUpdateResult.describe`) to a load FAILED_ENGINE failed."""
        loaded = served == load["weight_version"]
        if loaded:
            router.loads.append(load)
        engines = [
            {"id": "e1", "url": ENGINE, "success": loaded, "message": "ok" if loaded else "disk full", "seconds": 0.1},
            {"id": "e2", "url": FAILED_ENGINE, "success": False, "message": "shape mismatch", "seconds": 0.1},
        ]
        message = f"1/2 engines serve weight version {served!r}" if loaded else "no engine loaded it"
        body = {"success": False, "message": message, "weight_version": served, "engines": engines, "skipped": []}
        return JSONResponse(body, status_code=502)

    @app.get("/weight_version")
    async def served_version() -> JSONResponse:
        version = router.loads[-1]["weight_version"] if router.loads else None
        return JSONResponse({"weight_version": version, "model_path": None})

    @app.post("/weight_version/disk_copy")
    async def disk_copy(request: Request) -> JSONResponse:
        if router.fail_next > 0:
            router.fail_next -= 1
            return JSONResponse({"error": "router restarting"}, status_code=503)
        if router.disk_copy_conflict:
            message = f"weight_version: the fleet serves None, not {(await request.json())['weight_version']!r}"
            return JSONResponse({"error": {"kind": "conflict", "message": message, "code": 409}}, status_code=409)
        router.disk_copies.append(await request.json())
        return JSONResponse({"weight_version": router.disk_copies[-1]["weight_version"]})

    @app.post("/pause_generation")
    @app.post("/continue_generation")
    async def fan_out(request: Request) -> JSONResponse:
        router.calls.append(request.url.path)
        if request.url.path == "/pause_generation":
            router.pauses.append(await request.json())
        status = (
            router.continue_answers.pop(0)
            if request.url.path == "/continue_generation" and router.continue_answers
            else 200
        )
        engine = {"url": ENGINE, "status": None if status == 502 else status, "message": "ReadTimeout"}
        return JSONResponse({"success": status == 200, "engines": [engine]}, status_code=status)

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"workers": [{"url": ENGINE, "state": router.engine_state}], "total": 1})

    @app.post("/update_weights_from_distributed")
    async def refuse_bucket(request: Request) -> JSONResponse:
        router.calls.append(request.url.path)
        message = "engines ['http://127.0.0.1:30002'] of weight update group 'rlfleet-trainer' are out of routing"
        return JSONResponse({"error": {"message": message}}, status_code=409)

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake router did not start"
    yield router
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def core(
    tmp_path: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: FakeRouter
) -> Iterator[TrainerCore]:
    settings = TrainerSettings(redis_prefix=redis_prefix, work_dir=tmp_path / "trainer", read_block_ms=100)
    core = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    yield core
    core.shutdown()
