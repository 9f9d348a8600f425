"""A recording stand-in for the router's weight endpoint, served over real HTTP in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlfleet.processes import free_port


@dataclass
class FakeRouter:
    url: str
    loads: list[dict] = field(default_factory=list)
    fail_next: int = 0


@pytest.fixture
def fake_router() -> Iterator[FakeRouter]:
    port = free_port()
    router = FakeRouter(url=f"http://127.0.0.1:{port}")
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    async def load(request: Request) -> JSONResponse:
        if router.fail_next > 0:
            router.fail_next -= 1
            return JSONResponse({"success": False, "message": "engine down"}, status_code=503)
        router.loads.append(await request.json())
        return JSONResponse({"success": True, "message": "ok"})

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
