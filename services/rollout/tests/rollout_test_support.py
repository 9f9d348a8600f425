"""What the orchestrator's tests share: a fake fleet, the orchestrator as a real process, small specs.

The fake fleet lives in the test process: a trainer (gRPC) that reads the run's stream through the
consumer group and publishes a new weight version per `groups_per_step` groups, a router whose
greedy answers are right once the fleet serves version >= 1, and a reward hub that knows arith_exact.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlfleet.char_tokenizer import EOS, vocabulary
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.sample_stream import SampleStream
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet.v1.trainer_pb2 import StepReport, TrainerState, TrainerStatus

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
EOS_ID = vocabulary()[EOS]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        client.delete(*keys)


def spec_json(tokenizer_dir: Path, **overrides: Any) -> dict[str, Any]:
    """The protobuf JSON of a small valid RunSpec; `overrides` replace top-level sections."""
    spec: dict[str, Any] = {
        "name": "test",
        "model": {"path": str(tokenizer_dir)},
        "dataset": {"arithmetic": {"digits": 1, "ops": "+"}, "seed": 7, "eval_size": 6},
        "rollout": {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "schedule": {"steps": 3, "eval_every": 2},
    }
    spec.update(overrides)
    return spec


# -- the fake fleet -----------------------------------------------------------------------------


@dataclass
class FakeRun:
    run_id: str
    spec: RunSpec
    stream: SampleStream
    step: int = 0
    groups_trained: int = 0
    state: int = TrainerState.TRAINER_STATE_TRAINING
    known: bool = True
    reports: list[StepReport] = field(default_factory=list)
    trained_group_ids: list[str] = field(default_factory=list)
    trained: list[tuple[int, SampleGroup]] = field(default_factory=list)
    """Every trained group with the trainer's step when it trained it."""
    thread_alive: bool = False
    error: str = ""


class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    """Trains nothing, but consumes the stream exactly as the trainer does and bumps the weight version."""

    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        self.redis = redis_client
        self.prefix = prefix
        self.runs: dict[str, FakeRun] = {}
        self.paused = threading.Event()
        self.start_calls: list[str] = []
        self.stop_calls: list[str] = []
        self.version = 0  # what the fake router reports: the latest run's weight version
        self.watch_delay_s = 0.0  # WatchSteps calls reach the trainer this late (a busy or reconnecting channel)
        self._lock = threading.Lock()
        self._closing = threading.Event()

    def known_run(self, run_id: str, context: grpc.ServicerContext, started_only: bool = False) -> FakeRun:
        """The run `run_id`; NOT_FOUND, as the trainer answers, for one never started (or forgotten, when
        `started_only`: a test sets `known` False to play a trainer that restarted without it)."""
        run = self.runs.get(run_id)
        if run is None or (started_only and not run.known):
            context.abort(grpc.StatusCode.NOT_FOUND, f"run {run_id} is not known to this trainer")
            raise AssertionError("abort raises")
        return run

    def status_of(self, run: FakeRun) -> TrainerStatus:
        return TrainerStatus(
            run_id=run.run_id,
            state=TrainerState.ValueType(run.state),
            step=run.step,
            weight_version=run.step,
            groups_trained=run.groups_trained,
            error=run.error,
        )

    def StartRun(self, request: Any, context: grpc.ServicerContext) -> TrainerStatus:  # noqa: N802
        with self._lock:
            self.start_calls.append(request.run_id)
            run = self.runs.get(request.run_id)
            if run is None:
                stream = SampleStream(self.redis, request.run_id, prefix=self.prefix)
                stream.ensure_consumer_group()
                run = self.runs[request.run_id] = FakeRun(request.run_id, request.spec, stream)
                threading.Thread(target=self._train, args=(run,), daemon=True).start()
            run.known = True
            self.version = run.step
            return self.status_of(run)

    def Status(self, request: Any, context: grpc.ServicerContext) -> TrainerStatus:  # noqa: N802
        if not request.run_id:  # as the trainer answers: the run it is busy with, or IDLE
            training = [r for r in self.runs.values() if r.state == TrainerState.TRAINER_STATE_TRAINING]
            return self.status_of(training[0]) if training else TrainerStatus(state=TrainerState.TRAINER_STATE_IDLE)
        return self.status_of(self.known_run(request.run_id, context, started_only=True))

    def StopRun(self, request: Any, context: grpc.ServicerContext) -> TrainerStatus:  # noqa: N802
        self.stop_calls.append(request.run_id)
        run = self.known_run(request.run_id, context)
        run.state = TrainerState.TRAINER_STATE_STOPPED
        return self.status_of(run)

    def WatchSteps(self, request: Any, context: grpc.ServicerContext) -> Iterator[StepReport]:  # noqa: N802
        run = self.known_run(request.run_id, context)
        time.sleep(self.watch_delay_s)
        # As the trainer does: from_step 0 starts with the next step, any other replays from that step on.
        sent = len(run.reports) if request.from_step == 0 else sum(r.step < request.from_step for r in run.reports)
        while context.is_active() and run.state == TrainerState.TRAINER_STATE_TRAINING and not self._closing.is_set():
            while sent < len(run.reports):
                yield run.reports[sent]
                sent += 1
            time.sleep(0.05)

    def describe(self, run_id: str) -> str:
        """The fake's view of `run_id`, for a failing test's message."""
        run = self.runs.get(run_id)
        if run is None:
            return f"fake trainer: run {run_id} never started"
        return (
            f"fake trainer: state {TrainerState.Name(run.state)}, step {run.step}, paused {self.paused.is_set()}, "
            f"training thread alive {run.thread_alive}, StopRun calls {self.stop_calls.count(run_id)}, "
            f"stream length {run.stream.length()}, pending {run.stream.pending_count()}"
        )

    def _train(self, run: FakeRun) -> None:
        """As the trainer does, a fault fails the run with its reason instead of ending the thread silently."""
        run.thread_alive = True
        try:
            self._train_loop(run)
        except Exception as exc:  # noqa: BLE001 - reported through Status
            run.error = f"fake trainer: {exc!r}"
            run.state = TrainerState.TRAINER_STATE_FAILED
        finally:
            run.thread_alive = False

    def _train_loop(self, run: FakeRun) -> None:
        gps = run.spec.rollout.groups_per_step
        batch: list[Any] = []
        while run.state == TrainerState.TRAINER_STATE_TRAINING and not self._closing.is_set():
            if self.paused.is_set():
                time.sleep(0.05)
                continue
            # Own pending entries first, as the trainer reads them: a read the Redis client retried after a
            # timeout delivers its entries to this consumer without their reply.
            after = batch[-1].entry_id if batch else "0"
            batch += run.stream.read_own_pending("fake-trainer", gps - len(batch), after=after)
            if len(batch) < gps:
                batch += run.stream.read("fake-trainer", count=gps - len(batch), block_ms=100)
            if len(batch) < gps:
                continue
            run.stream.ack(e.entry_id for e in batch)
            run.trained_group_ids += [e.group.group_id for e in batch]
            run.trained += [(run.step, e.group) for e in batch]
            run.groups_trained += len(batch)
            run.step += 1
            run.reports.append(
                StepReport(
                    run_id=run.run_id,
                    step=run.step,
                    weight_version=run.step,
                    metrics={"loss": 1.0 / run.step},
                    groups=len(batch),
                )
            )
            self.version = run.step
            batch = []

    def close(self) -> None:
        self._closing.set()


def _answer(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def build_fake_router(
    trainer: FakeTrainer, down: threading.Event, lag_versions: list[int], seeds_seen: list[int | None]
) -> FastAPI:
    """SGLang's /generate shape; greedy answers are right from weight version 1 on; 503 while `down` is set.

    The engines serve `lag_versions[0]` versions behind the trainer; every sampling_seed asked for is noted.
    """
    app = FastAPI()
    inverse = {i: tok for tok, i in vocabulary().items()}
    rng = random.Random(0)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        if down.is_set():
            return JSONResponse({"error": "no healthy engine"}, status_code=503)
        body = await request.json()
        rids = body.get("rid")
        if not isinstance(rids, list) or len(rids) != len(body["input_ids"]) or len(set(rids)) != len(rids):
            return JSONResponse({"error": "rid must hold one unique id per prompt"}, status_code=400)
        per_prompt = body["sampling_params"]
        if not isinstance(per_prompt, list):
            per_prompt = [per_prompt] * len(body["input_ids"])
        version = trainer.version - lag_versions[0] if trainer.version >= lag_versions[0] else 0
        out = []
        for ids, params in zip(body["input_ids"], per_prompt, strict=True):
            seeds_seen.append(params.get("sampling_seed"))
            prompt = "".join(inverse[i] for i in ids)
            seed = params.get("sampling_seed")
            draw = random.Random(seed).random() if seed is not None else rng.random()  # seeded: reproducible
            right = version >= 1 if params["temperature"] == 0 else draw < 0.3 + 0.3 * version
            text = _answer(prompt) if right else str(int(_answer(prompt)) + 1)
            output_ids = [vocabulary()[c] for c in text] + [EOS_ID]
            finish = "stop"
            if len(output_ids) > params["max_new_tokens"]:
                output_ids, finish = output_ids[: params["max_new_tokens"]], "length"
            meta = {
                "id": uuid.uuid4().hex,
                "finish_reason": {"type": finish},
                "prompt_tokens": len(ids),
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "weight_version": str(version),
                "output_token_logprobs": [[-0.1, t, None] for t in output_ids],
            }
            out.append({"text": text, "output_ids": output_ids, "meta_info": meta})
        return out

    return app


def build_fake_reward_hub() -> FastAPI:
    app = FastAPI()

    @app.post("/validate")
    async def validate(request: Request) -> dict[str, Any]:
        terms = (await request.json())["spec"].get("terms", [])
        unknown = [(i, t.get("function")) for i, t in enumerate(terms) if t.get("function") != "arith_exact"]
        message = "unknown reward function {!r}; known: arith_exact"
        return {"problems": [{"field": f"terms[{i}].function", "message": message.format(f)} for i, f in unknown]}

    @app.post("/score")
    async def score(request: Request) -> dict[str, Any]:
        body = await request.json()
        weight = sum(t.get("weight", 1.0) for t in body["spec"]["terms"])
        results = []
        for item in body["items"]:
            hit = 1.0 if item.get("response", "").split("\n")[0].strip() == item.get("label") else 0.0
            results.append(
                {
                    "id": item["id"],
                    "status": "SCORE_STATUS_OK",
                    "score": weight * hit,
                    "components": {"arith_exact": hit},
                }
            )
        return {"results": results}

    return app


class ThreadedUvicorn:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, f"the fake server on port {self.port}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class FakeFleet:
    prefix: str
    trainer: FakeTrainer
    trainer_address: str
    router_url: str
    reward_url: str
    router_down: threading.Event
    router_lag: list[int]
    router_seeds: list[int | None]
    _stop: Callable[[], None]

    def stop(self) -> None:
        self._stop()


def start_fake_fleet(redis_client: redis.Redis, prefix: str, trainer: FakeTrainer | None = None) -> FakeFleet:
    """`trainer`: a FakeTrainer (or a subclass playing some fault) on `redis_client` and `prefix`."""
    trainer = trainer or FakeTrainer(redis_client, prefix)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    router_down = threading.Event()
    router_lag: list[int] = [0]
    router_seeds: list[int | None] = []
    router = ThreadedUvicorn(build_fake_router(trainer, router_down, router_lag, router_seeds))
    hub = ThreadedUvicorn(build_fake_reward_hub())

    def stop() -> None:
        trainer.close()
        server.stop(grace=1).wait(5)
        router.stop()
        hub.stop()

    return FakeFleet(
        prefix, trainer, f"127.0.0.1:{port}", router.url, hub.url, router_down, router_lag, router_seeds, stop
    )


# -- the orchestrator as a real process ---------------------------------------------------------


@dataclass
class Orchestrator:
    process: ServiceProcess
    url: str
    grpc_address: str


def start_orchestrator(
    fleet: FakeFleet, log_path: Path, *, reward_url: str | None = None, env: dict[str, str] | None = None
) -> Orchestrator:
    """The orchestrator as a process on `fleet`; `env`: more RLFLEET_ROLLOUT_* settings."""
    port, grpc_port = free_port(), free_port()
    variables = {
        "RLFLEET_ROLLOUT_REDIS_URL": REDIS_URL,
        "RLFLEET_ROLLOUT_REDIS_PREFIX": fleet.prefix,
        "RLFLEET_ROLLOUT_ROUTER_URL": fleet.router_url,
        "RLFLEET_ROLLOUT_REWARD_URL": reward_url or fleet.reward_url,
        "RLFLEET_ROLLOUT_TRAINER_ADDRESS": fleet.trainer_address,
        "RLFLEET_ROLLOUT_POLL_INTERVAL_S": "0.05",
        "RLFLEET_ROLLOUT_STEP_TIMEOUT_S": "30",
        "RLFLEET_ROLLOUT_GENERATE_TIMEOUT_S": "2",
        "RLFLEET_ROLLOUT_SHUTDOWN_GRACE_S": "1",
        "RLFLEET_LOG_FORMAT": "text",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "rlfleet_rollout", "--port", str(port), "--grpc-port", str(grpc_port)]
    process = ServiceProcess("rollout", argv, log_path, env=variables)
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_healthy(f"{url}/health", timeout=30)
    except RuntimeError:
        process.stop()
        raise
    return Orchestrator(process, url, f"127.0.0.1:{grpc_port}")


def wait_for_state(url: str, run_id: str, states: set[str], timeout: float) -> dict[str, Any]:
    """Polls GET /v1/runs/{id} until its state is one of `states`; returns the run."""
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(httpx.get(f"{url}/v1/runs/{run_id}", timeout=5).json())
        return seen.get("state") in states

    wait_until(reached, timeout, f"run {run_id} to reach {states} (last: {seen.get('state')} {seen.get('error')})")
    return seen
