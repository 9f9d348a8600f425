"""Opening the weight update group when the router fails after the engines joined (it died or restarted mid-open):
the trainer's end of the group joins all the same, after the open has failed; left registered under the group's
name, it refused every later open of that name (ValueError, which no fallback catches), so no version could be
broadcast or even loaded from disk again."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlfleet.errors import Unavailable
from rlfleet.processes import free_port
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_broadcast import WeightBroadcaster

TIMEOUT_S = 10.0

# An engine joining as rank 1 of 2 over gloo, as rlfleet-engine and SGLang join; it stays until killed.
ENGINE = """
import sys, time
from rlfleet.weight_update_group import open_group
open_group(sys.argv[1], int(sys.argv[2]), 1, 2, sys.argv[3], "gloo", float(sys.argv[4]))
print("joined", flush=True)
time.sleep(float(sys.argv[4]))
"""


@dataclass
class JoiningRouter:
    url: str
    fail_opens: int = 0
    """How many of the next opens answer 503 once the engine has joined."""
    engines: list[subprocess.Popen[str]] = field(default_factory=list)


@pytest.fixture
def router() -> Iterator[JoiningRouter]:
    port = free_port()
    state = JoiningRouter(url=f"http://127.0.0.1:{port}")
    app = FastAPI()

    @app.get("/weights_update_world_size")
    async def world() -> dict[str, object]:
        return {"world_size": 2, "engines": [{"url": "http://127.0.0.1:1"}]}

    @app.post("/init_weights_update_group")
    async def init(request: Request) -> JSONResponse:
        body = await request.json()
        argv = [body["master_address"], str(body["master_port"]), body["group_name"], str(TIMEOUT_S)]
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, *argv], stdout=subprocess.PIPE, text=True)
        state.engines.append(engine)
        assert engine.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(engine.stdout.readline), TIMEOUT_S + 5)
        if state.fail_opens > 0:
            state.fail_opens -= 1
            return JSONResponse({"error": "router restarting"}, status_code=503)
        return JSONResponse({"success": line.startswith("joined"), "message": line})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the router stand-in did not start"
    yield state
    for engine in state.engines:
        engine.kill()
        engine.wait(10)
    server.should_exit = True
    thread.join(timeout=10)


def test_a_group_joined_after_its_open_failed_is_torn_down_and_opens_again(router: JoiningRouter) -> None:
    router.fail_opens = 1
    broadcaster = WeightBroadcaster(RouterClient(router.url, 10.0), "127.0.0.1", "gloo", 1.0, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(Unavailable, match="HTTP 503"):
            broadcaster.open()
        assert broadcaster.group is None
        broadcaster.open()
        assert broadcaster.group is not None and broadcaster.group.world_size == 2
    finally:
        if broadcaster.group is not None:
            broadcaster.group.abort()
