"""A real orchestrator process hands the trainer from a run that is over to the next one.

The audit's flow: run A is cancelled while the trainer cannot answer StopRun within its deadline, and
run B, queued behind it, used to fail ("the trainer is busy with run A") while the trainer kept A for
good. And an orchestrator that died after recording CANCELLED but before StopRun: the next one frees
the trainer as it starts.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import redis.asyncio as aioredis
from google.protobuf import json_format
from rollout_test_support import (
    REDIS_URL,
    FakeFleet,
    FakeTrainer,
    spec_json,
    start_fake_fleet,
    start_orchestrator,
    wait_for_state,
    wait_until,
)

from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import Run, RunProgress, RunSpec, RunState
from rlfleet.v1.trainer_pb2 import StartRunRequest, TrainerState, TrainerStatus
from rlfleet_rollout.run_store import RunStore


class OneRunTrainer(FakeTrainer):
    """The fake trainer holding one run at a time, as the trainer does (StartRun of another run is
    FAILED_PRECONDITION until StopRun), and losing the next `lost_stops` StopRun calls: each is answered
    only after its caller gave up, and stops nothing, as a trainer paused (or in a long step) past
    StopRun's deadline."""

    def __init__(self, redis_client: redis.Redis, prefix: str) -> None:
        super().__init__(redis_client, prefix)
        self.lost_stops = 0

    def StartRun(self, request: Any, context: grpc.ServicerContext) -> TrainerStatus:  # noqa: N802
        training = TrainerState.TRAINER_STATE_TRAINING
        busy = [r.run_id for r in self.runs.values() if r.state == training and r.run_id != request.run_id]
        if busy:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the trainer is busy with run {busy[0]}")
        return super().StartRun(request, context)

    def StopRun(self, request: Any, context: grpc.ServicerContext) -> TrainerStatus:  # noqa: N802
        if self.lost_stops > 0:
            self.lost_stops -= 1
            self.stop_calls.append(request.run_id)
            time.sleep((context.time_remaining() or 0) + 0.1)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "answered after the caller left")
        return super().StopRun(request, context)


@pytest.fixture
def one_run_fleet(redis_client: redis.Redis, redis_prefix: str) -> Any:
    fleet = start_fake_fleet(redis_client, redis_prefix, trainer=OneRunTrainer(redis_client, redis_prefix))
    yield fleet
    fleet.stop()


def _run(url: str, run_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/runs/{run_id}", timeout=5).json()


@pytest.mark.e2e
def test_a_run_queued_behind_a_cancel_the_trainer_did_not_hear_in_time_starts_and_succeeds(
    one_run_fleet: FakeFleet, tokenizer_dir: Path, tmp_path: Path
) -> None:
    fleet = one_run_fleet
    trainer = fleet.trainer
    assert isinstance(trainer, OneRunTrainer)
    orch = start_orchestrator(fleet, tmp_path / "rollout.log", env={"RLFLEET_ROLLOUT_TRAINER_CALL_TIMEOUT_S": "0.5"})
    try:
        trainer.paused.set()  # A stays RUNNING after its first step's groups
        a = httpx.post(f"{orch.url}/v1/runs", json=spec_json(tokenizer_dir, name="a"), timeout=10).json()["id"]
        b = httpx.post(f"{orch.url}/v1/runs", json=spec_json(tokenizer_dir, name="b"), timeout=10).json()["id"]
        wait_until(lambda: _run(orch.url, a)["progress"].get("groups_produced") == "2", 20, "run a's first step")
        trainer.lost_stops = 2
        assert httpx.post(f"{orch.url}/v1/runs/{a}:cancel", timeout=5).status_code == 200
        trainer.paused.clear()  # the trainer trains A's groups before a StopRun reaches it
        final = wait_for_state(orch.url, b, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
        assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
        assert trainer.stop_calls.count(a) == 3  # two lost, the third heard
        cancelled = _run(orch.url, a)
        assert cancelled["state"] == "RUN_STATE_CANCELLED"
        # The record holds what the trainer did up to the stop, the step it took after the cancel included.
        assert trainer.runs[a].step == 1 and cancelled["progress"]["step"] == "1"
        assert cancelled["progress"]["groups_trained"] == "2"
    finally:
        orch.process.stop(timeout=15)


@pytest.mark.e2e
def test_an_orchestrator_frees_the_trainer_of_a_run_cancelled_before_it_started(
    one_run_fleet: FakeFleet, tokenizer_dir: Path, tmp_path: Path, redis_prefix: str
) -> None:
    """The previous orchestrator recorded CANCELLED and died before its StopRun."""
    fleet = one_run_fleet
    spec = json_format.ParseDict(spec_json(tokenizer_dir), RunSpec())
    with grpc.insecure_channel(fleet.trainer_address) as channel:
        trainer_pb2_grpc.TrainerStub(channel).StartRun(StartRunRequest(run_id="run-x", spec=spec), timeout=10)
    fleet.trainer.runs["run-x"].step, fleet.trainer.runs["run-x"].groups_trained = 4, 8
    progress = RunProgress(step=3, weight_version=3, groups_trained=6, total_steps=3)
    asyncio.run(_store(redis_prefix, Run(id="run-x", spec=spec, state=RunState.RUN_STATE_CANCELLED, progress=progress)))

    log = tmp_path / "rollout.log"
    orch = start_orchestrator(fleet, log)
    try:
        wait_until(lambda: _run(orch.url, "run-x")["progress"]["step"] == "4", 20, "run-x's final progress")
        assert fleet.trainer.stop_calls == ["run-x"]
        assert "the trainer was freed from run run-x (CANCELLED)" in log.read_text()
        assert _run(orch.url, "run-x")["state"] == "RUN_STATE_CANCELLED"
    finally:
        orch.process.stop(timeout=15)


async def _store(prefix: str, run: Run) -> None:
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        await RunStore(client, prefix).create(run)
    finally:
        await client.aclose()
