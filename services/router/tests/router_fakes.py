"""Test doubles of the router's tests: a fake SGLang engine, in-thread servers, a fake restarter, a router handle.

The fake engine speaks the subset of SGLang's HTTP API the router uses, records what it received
(raw bodies, weight loads, in order) and can be told to fail, so each routing rule can be checked
without a model. It lives in a plain module (not the conftest) so test modules can import its types.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp

from rlfleet.processes import free_port
from rlfleet_router import fleet as fleet_module


class ThreadedServer:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread; start/stop are bounded."""

    def __init__(self, app: ASGIApp, port: int | None = None, http: type[asyncio.Protocol] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", http=http or "auto"
        )
        self.server = uvicorn.Server(config)
        self.server.config.timeout_graceful_shutdown = 1
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 10.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"server on port {self.port} did not stop within {timeout}s")


@dataclass
class FakeEngine:
    """SGLang-shaped engine. Set the public attributes to change its behaviour mid-test."""

    name: str
    weight_version: str = "0"
    model_path: str = "/models/initial"
    weights_partial: bool = False  # holds part of a weight version (rlfleet-engine's report); a disk load ends it
    healthy: bool = True
    health_trickle: float = 0.0  # seconds between the bytes of a /health answer that never ends (30 s at most)
    hang: bool = False  # /generate (plain or streamed) waits for an /abort_request of its rid (30 s at most)
    dies_mid_answer: bool = False  # a plain /generate answer stops after a fifth of its announced length
    generate_status: int = 200
    fail_updates: bool = False
    update_delay: float = 0.0
    control_delay: float = 0.0  # before answering /abort_request, /pause_generation, ...
    # As SGLang: an /abort_request of a rid no /generate here carries is dropped (not kept for a later request), and
    # a /generate carries its rids (each of a batch's) only `rid_delay` after its body arrived.
    drops_unknown_aborts: bool = False
    rid_delay: float = 0.0
    serves_openai: bool = False  # /v1/completions and /v1/chat/completions served as /generate
    tp_size: int = 1  # /server_info's: the ranks it takes in a weight update group
    # As SGLang 0.5.23 on: /begin_weight_update ... /end_weight_update, one session open at a time (404 without
    # `sessions`, as before 0.5.23). A disk load inside a session keeps the old version reported until the end
    # publishes it, as later SGLang publishes the version of an update inside a session.
    sessions: bool = False
    session_open: bool = False
    session_events: list[str] = field(default_factory=list)  # "begin" and "end" as answered
    _held_version: str | None = None  # a disk load's version, held back until the session ends
    # The routes that answer what it serves: SGLang before 0.5 has only the legacy one, 0.5.23 both (logging the
    # legacy one as deprecated at every call), a later one may have only /model_info.
    info_routes: tuple[str, ...] = ("/get_model_info",)
    info_calls: list[str] = field(default_factory=list)  # the paths asked, in order
    # Likewise for its server info: SGLang before /server_info has only /get_server_info, later ones both (logging
    # /get_server_info as deprecated at every call and announcing its removal).
    server_info_routes: tuple[str, ...] = ("/get_server_info",)
    server_info_calls: list[str] = field(default_factory=list)  # the paths asked, in order
    # Control routes (and /end_weight_update) answered `refused_with` (503) and not applied.
    refused_controls: set[str] = field(default_factory=set)
    refused_with: int = 503  # the status of those refusals
    control_queries: list[str] = field(default_factory=list)  # the query string of each control request
    raw_bodies: list[bytes] = field(default_factory=list)
    content_types: list[str | None] = field(default_factory=list)  # of each /generate request
    tags: list[list[str]] = field(default_factory=list)  # the X-Tag lines of each /generate request
    update_bodies: list[dict[str, object]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # "generate" / "update" as they arrive, "abort" as applied
    controls: list[tuple[str, str | None, bytes]] = field(default_factory=list)  # fan-out: route, type, body
    in_flight: int = 0
    max_in_flight: int = 0
    streams_cut: int = 0  # streams whose reader left before their end
    server: ThreadedServer | None = None
    _aborted: dict[str, asyncio.Event] = field(default_factory=dict)  # by rid, set by /abort_request
    _died: set[str] = field(default_factory=set)  # rids whose plain answer stopped short ("dies_once" in a body)
    _carried: list[str] = field(default_factory=list)  # the rids of the /generate requests here

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            raw = await request.body()
            self.raw_bodies.append(raw)
            self.content_types.append(request.headers.get("content-type"))
            self.tags.append(request.headers.getlist("x-tag"))
            self.events.append("generate")
            if self.generate_status != 200:
                return JSONResponse({"error": "engine fault"}, status_code=self.generate_status)
            body = json.loads(raw)
            if body.get("stream"):
                return StreamingResponse(self._sse(body), media_type="text/event-stream")
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await asyncio.sleep(self.rid_delay)
            rid = body.get("rid")
            rids = [str(r) for r in rid] if isinstance(rid, list) else [str(rid)]
            self._carried.extend(rids)
            try:
                await self._work(body, float(body.get("delay", 0)))
            finally:
                self.in_flight -= 1
                for carried in rids:
                    self._carried.remove(carried)
            if self.dies_mid_answer or (body.get("dies_once") and body.get("rid") not in self._died):
                self._died.add(str(body.get("rid")))
                whole = json.dumps(self._answer(body)).encode()
                headers = {"content-length": str(len(whole))}
                return StreamingResponse(_cut(whole, self.name), headers=headers, media_type="application/json")
            if "trickle" in body:  # a plain answer (with its length) written a few bytes at a time, this far apart
                whole = json.dumps(self._answer(body)).encode()
                pieces = (whole[i : i + 8] for i in range(0, len(whole), 8))
                headers = {"content-length": str(len(whole))}
                return StreamingResponse(
                    _spaced(pieces, body["trickle"]), headers=headers, media_type="application/json"
                )
            return JSONResponse(self._answer(body))

        if self.serves_openai:  # the same body flags, answered in /generate's shape
            for openai_route in ("/v1/completions", "/v1/chat/completions"):
                app.add_api_route(openai_route, generate, methods=["POST"])

        @app.get("/health")
        @app.get("/health_generate")
        async def health() -> Response:
            if self.health_trickle:  # each byte well within a read timeout, the whole answer past any
                trickle = self.health_trickle
                return StreamingResponse(_spaced(iter([b" "] * int(30 / trickle)), trickle), media_type="text/plain")
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def get_model_info(request: Request) -> Response:
            self.info_calls.append(request.url.path)
            if request.url.path not in self.info_routes:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            info = {
                "model_path": self.model_path,
                "weight_version": self.weight_version,
                "is_generation": True,
                "weights_partial": self.weights_partial,
            }
            return JSONResponse(info)

        @app.get("/server_info")
        @app.get("/get_server_info")
        async def get_server_info(request: Request) -> Response:
            self.server_info_calls.append(request.url.path)
            if request.url.path not in self.server_info_routes:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"engine": self.name, "weight_version": self.weight_version, "tp_size": self.tp_size})

        @app.post("/update_weights_from_disk")
        async def update_weights(request: Request) -> Response:
            body = await request.json()
            self.update_bodies.append(body)
            await asyncio.sleep(self.update_delay)
            if self.fail_updates:
                return JSONResponse({"success": False, "message": "cannot read checkpoint"}, status_code=400)
            self.events.append("update")
            if self.session_open:
                self._held_version = str(body["weight_version"])
            else:
                self.weight_version = str(body["weight_version"])
            self.model_path = str(body["model_path"])
            self.weights_partial = False
            return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

        not_found = JSONResponse({"detail": "Not Found"}, status_code=404)

        @app.post("/begin_weight_update")
        async def begin() -> Response:
            if not self.sessions:
                return not_found
            if self.session_open:
                refusal = "a weight-update session is already open; call end_weight_update() first"
                return JSONResponse({"success": False, "message": refusal}, status_code=400)
            self.session_open = True
            self.session_events.append("begin")
            return JSONResponse({"success": True, "message": "Success"})

        @app.post("/end_weight_update")
        async def end() -> Response:
            if not self.sessions:
                return not_found
            if "/end_weight_update" in self.refused_controls:
                return JSONResponse({"detail": "refused"}, status_code=self.refused_with)
            if not self.session_open:
                refusal = "no weight-update session is open; call begin_weight_update() first"
                return JSONResponse({"success": False, "message": refusal}, status_code=400)
            self.session_open = False
            if self._held_version is not None:
                self.weight_version, self._held_version = self._held_version, None
            self.session_events.append("end")
            return JSONResponse({"success": True, "message": "Success"})

        async def control(request: Request) -> Response:
            """Like SGLang's: a body is read as JSON only under a JSON Content-Type."""
            body, content_type = await request.body(), request.headers.get("content-type")
            self.controls.append((request.url.path, content_type, body))
            self.control_queries.append(request.url.query)
            await asyncio.sleep(self.control_delay)
            if body and content_type != "application/json":
                return JSONResponse({"detail": "body: not read as JSON"}, status_code=400)
            if request.url.path in self.refused_controls:
                return JSONResponse({"detail": "refused"}, status_code=self.refused_with)
            if request.url.path == "/abort_request":
                rid = str(json.loads(body).get("rid", ""))
                if self.drops_unknown_aborts and rid not in self._carried:
                    return JSONResponse({"success": True})
                self._aborted.setdefault(rid, asyncio.Event()).set()
                self.events.append("abort")
            return JSONResponse({"success": True})

        for route in ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache"):
            app.add_api_route(route, control, methods=["POST"])

        return app

    def _answer(self, body: dict[str, object]) -> dict[str, object]:
        pad = body.get("pad", 0)  # characters of filler in the text
        assert isinstance(pad, int), "pad: int"
        return {
            "text": f"answer from {self.name}" + "x" * pad,
            "meta_info": {"engine": self.name, "weight_version": self.weight_version},
        }

    def aborted(self) -> list[str]:
        """The rids this engine was asked to abort, in order."""
        return [json.loads(body)["rid"] for route, _, body in self.controls if route == "/abort_request"]

    async def _work(self, body: dict[str, object], seconds: float) -> None:
        """Generation time: `seconds`, or 30 s if the engine hangs; an /abort_request of the body's rid ends it."""
        aborted = self._aborted.setdefault(str(body.get("rid", "")), asyncio.Event())
        try:
            await asyncio.wait_for(aborted.wait(), 30.0 if self.hang else seconds)
        except TimeoutError:
            pass

    async def _sse(self, body: dict[str, object]) -> AsyncIterator[bytes]:
        chunks, delay = body.get("chunks", 3), body.get("chunk_delay", 0.05)
        cut_after = body.get("cut_after")  # events sent before the engine dies mid-stream
        pad = body.get("pad", 0)  # characters of filler in each event
        assert isinstance(chunks, int) and isinstance(delay, (int, float)), "chunks: int, chunk_delay: seconds"
        assert isinstance(pad, int), "pad: int"
        finished = False
        try:
            if self.hang:
                await self._work(body, 0)
            for i in range(chunks):
                if i == cut_after:
                    raise ConnectionAbortedError(f"{self.name} dies mid-stream")  # uvicorn drops the connection
                event = {"index": i, "engine": self.name, **({"pad": "x" * pad} if pad else {})}
                yield f"data: {json.dumps(event)}\n\n".encode()
                await asyncio.sleep(delay)
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            self.streams_cut += not finished


async def _cut(whole: bytes, name: str) -> AsyncIterator[bytes]:
    yield whole[: len(whole) // 5]
    raise ConnectionAbortedError(f"{name} dies mid-answer")  # uvicorn drops the connection


async def _spaced(pieces: Iterator[bytes], seconds: object) -> AsyncIterator[bytes]:
    assert isinstance(seconds, (int, float)), "trickle: seconds between pieces"
    for piece in pieces:
        yield piece
        await asyncio.sleep(seconds)


class GatedEngine:
    """A fake engine with SGLang's two gates on generation: while a weight update runs (`model_update_lock`)
    or generation is paused (`is_pause`), /generate, /health_generate and /health wait, as SGLang's health
    handler runs a one-token generation; /get_model_info, the weight routes and the control routes do not.
    With `gated=("/generate",)` its probes answer at once, as rlfleet-engine's do while it is paused."""

    GATED = ("/generate", "/health", "/health_generate")

    def __init__(self, name: str, gated: tuple[str, ...] = GATED, port: int | None = None, **attrs: object) -> None:
        self.engine = FakeEngine(name=name, **attrs)  # type: ignore[arg-type]
        self.gated = gated
        self.loading = 0  # weight updates running
        self.paused = False
        self.app = app = self.engine.app()  # routes may be added until start()

        @app.middleware("http")
        async def gates(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            path = request.url.path
            if path in self.gated:
                while self.loading or self.paused:
                    await asyncio.sleep(0.02)
            if path != "/update_weights_from_disk":
                response = await call_next(request)
                if path in ("/pause_generation", "/continue_generation") and response.status_code == 200:
                    self.paused = path == "/pause_generation"
                return response
            self.loading += 1
            try:
                return await call_next(request)
            finally:
                self.loading -= 1

        self.engine.server = ThreadedServer(app, port=port)

    @property
    def url(self) -> str:
        return self.engine.url

    def start(self) -> GatedEngine:
        assert self.engine.server is not None
        self.engine.server.start()
        return self


class RelaunchingRestarter:
    """A restarter for a router in this process (`restarter_settings`): `restart(url)` records the URL and calls
    `relaunch(url)` in a thread, which starts a new fake engine there (the test stopped the old one), then
    returns the URL; `release(url)` is recorded. Set `gate` to hold restarts until it is set."""

    def __init__(self, relaunch: Callable[[str], object] | None = None) -> None:
        self.relaunch = relaunch
        self.restarts: list[str] = []
        self.released: list[str] = []
        self.gate: threading.Event | None = None

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.restarts.append(url)
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 30.0)
        if self.relaunch is not None:
            await asyncio.to_thread(self.relaunch, url)
        return url

    async def release(self, url: str) -> None:
        self.released.append(url)

    async def close(self) -> None:
        pass


def restarter_settings(monkeypatch: pytest.MonkeyPatch, restarter: object) -> dict[str, object]:
    """Router settings (for `start_router`) under which the router's restarter is `restarter`."""
    monkeypatch.setattr(fleet_module, "create_restarter", lambda name, config: restarter)
    return {"restarter": "docker"}  # a real name, so the settings validate; never created


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


@dataclass
class RunningRouter:
    server: ThreadedServer
    client: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def workers(self) -> list[dict[str, object]]:
        return self.client.get("/workers").json()["workers"]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout}s; workers: {self.workers()}")
            time.sleep(0.02)

    def wait_healthy(self, count: int, timeout: float = 10.0) -> None:
        self.wait_for(
            lambda: sum(bool(w["healthy"]) for w in self.workers()) == count, timeout, f"{count} healthy workers"
        )


def metric_value(exposition: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in a Prometheus text exposition, or None if absent."""
    for line in exposition.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        series_name, _, label_text = series.partition("{")
        if series_name != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in (labels or {}).items()):
            return float(value)
    return None
