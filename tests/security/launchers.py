"""Real service processes on loopback for the security and load tests: sim engines, a router, an
orchestrator, and a stand-in reward hub (in a thread) that knows one function.

Each launcher waits for health with a deadline and hands back a `Service` the caller stops by pid.
The orchestrator's trainer address points at a closed port: these tests exercise the Runs API, and
a run the queue picks up fails at once instead of training.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
import uvicorn
from fastapi import FastAPI, Request

from rlfleet.char_tokenizer import SPECIAL_TOKENS, UNK, vocabulary
from rlfleet.processes import ServiceProcess, free_port

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass
class Service:
    process: ServiceProcess
    url: str
    grpc_address: str = ""

    def stop(self) -> int | None:
        return self.process.stop(timeout=15)


def write_token(directory: Path) -> tuple[str, Path]:
    """A fresh random token and the file holding it (mode 0600, as a mounted secret would be)."""
    token = secrets.token_urlsafe(32)
    path = directory / "api_token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, path


def write_char_tokenizer(out: Path) -> Path:
    """A model directory as submit reads it, in `out`: the tiny model's character tokenizer (tokenizer.json)
    and a config.json (submit checks only that it is there)."""
    from tokenizers import Tokenizer, decoders, models

    core = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    core.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text("{}")
    return out


def start_sim_engines(count: int, logs: Path, extra: Sequence[str] = ()) -> list[Service]:
    engines = []
    for _ in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "rlfleet_engine", "--backend", "sim", "--model-path", "sim", "--port", str(port)]
        argv += ["--log-level", "warning", *extra]
        engines.append(
            Service(ServiceProcess("sim-engine", argv, logs / f"sim-{port}.log"), f"http://127.0.0.1:{port}")
        )
    for engine in engines:
        engine.process.wait_healthy(engine.url + "/health", timeout=60)
    return engines


def start_router(worker_urls: Sequence[str], logs: Path, token_file: Path | None = None) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "rlfleet_router", "--port", str(port), "--policy", "least_load"]
    argv += ["--health-check-endpoint", "/health", "--health-check-interval-secs", "0.5", "--log-level", "warning"]
    if token_file:
        argv += ["--api-token-file", str(token_file)]
    argv += ["--worker-urls", *worker_urls]
    router = Service(ServiceProcess("router", argv, logs / f"router-{port}.log"), f"http://127.0.0.1:{port}")
    router.process.wait_healthy(router.url + ("/health" if worker_urls else "/liveness"), timeout=60)
    return router


def start_orchestrator(
    logs: Path, *, prefix: str, reward_url: str, router_url: str, token_file: Path | None = None
) -> Service:
    port, grpc_port = free_port(), free_port()
    env = {
        "RLFLEET_ROLLOUT_REDIS_URL": REDIS_URL,
        "RLFLEET_ROLLOUT_REDIS_PREFIX": prefix,
        "RLFLEET_ROLLOUT_ROUTER_URL": router_url,
        "RLFLEET_ROLLOUT_REWARD_URL": reward_url,
        "RLFLEET_ROLLOUT_TRAINER_ADDRESS": f"127.0.0.1:{free_port()}",
        "RLFLEET_ROLLOUT_TRAINER_START_TIMEOUT_S": "2",
        "RLFLEET_ROLLOUT_SHUTDOWN_GRACE_S": "1",
        "RLFLEET_ROLLOUT_LOG_LEVEL": "warning",
        "RLFLEET_LOG_FORMAT": "text",
    }
    if token_file:
        env["RLFLEET_ROLLOUT_API_TOKEN_FILE"] = str(token_file)
    argv = [sys.executable, "-m", "rlfleet_rollout", "--port", str(port), "--grpc-port", str(grpc_port)]
    process = ServiceProcess("rollout", argv, logs / f"rollout-{port}.log", env=env)
    service = Service(process, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}")
    try:
        process.wait_healthy(service.url + "/health", timeout=60)
    except RuntimeError:
        process.stop()
        raise
    return service


class StandInRewardHub:
    """The reward hub's `/validate` (all a submit asks it) for a hub that knows only arith_exact, in a thread."""

    def __init__(self) -> None:
        app = FastAPI()

        @app.post("/validate")
        async def validate(request: Request) -> dict[str, object]:
            terms = (await request.json())["spec"].get("terms", [])
            unknown = [(i, t.get("function")) for i, t in enumerate(terms) if t.get("function") != "arith_exact"]
            message = "unknown reward function {!r}; known: arith_exact"
            return {"problems": [{"field": f"terms[{i}].function", "message": message.format(f)} for i, f in unknown]}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stand-in reward hub did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def stored_runs(client: redis.Redis, prefix: str) -> int:
    """Run records under `prefix`: what "nothing stored" is checked against."""
    return sum(1 for _ in client.scan_iter(match=f"{prefix}run:*:record", count=500))


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        client.delete(*keys)
