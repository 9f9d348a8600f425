"""StopRun, and Status without a run id, as the orchestrator relies on them to free the trainer of a run
that is over: a stop waits for the step in progress but answers within its caller's deadline (the stop
stands; ask again), a stop during StartRun ends the run as soon as it is loaded, and asking again once
the run has stopped gets the same answer."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from rlfleet.sample_stream import SampleStream
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import (
    CheckpointRequest,
    StatusRequest,
    StopRunRequest,
    TrainerState,
    TrainerStatus,
    WatchStepsRequest,
)
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.trainer_core import TrainerCore

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import rollout_group, serve_grpc, spec_for, wait_for  # noqa: E402

IDLE, STARTING = TrainerState.TRAINER_STATE_IDLE, TrainerState.TRAINER_STATE_STARTING
TRAINING, STOPPED = TrainerState.TRAINER_STATE_TRAINING, TrainerState.TRAINER_STATE_STOPPED


def test_status_without_a_run_id_names_the_run_the_trainer_is_busy_with(
    core: TrainerCore, small_model_dir: Path
) -> None:
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            assert stub.Status(StatusRequest(), timeout=10) == TrainerStatus(state=IDLE)
            core.start_run("a", spec_for(small_model_dir, steps=5, groups_per_step=1))
            held = stub.Status(StatusRequest(), timeout=10)
            assert (held.run_id, held.state) == ("a", TRAINING)
            stub.StopRun(StopRunRequest(run_id="a"), timeout=10)
            assert stub.Status(StatusRequest(), timeout=10) == TrainerStatus(state=IDLE)
            with pytest.raises(grpc.RpcError) as no_id:
                stub.StopRun(StopRunRequest(), timeout=10)
            assert no_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "run_id" in (no_id.value.details() or "")
    finally:
        done.set()


def in_weight_load(core: TrainerCore, model_dir: Path, stream: SampleStream, fake_router: Any) -> None:
    """Starts run `stream.run_id` and gives it a group: its first step then waits in a 3 s weight load, longer
    than the 2 s deadlines the tests call with."""
    run_id = stream.run_id
    core.start_run(run_id, spec_for(model_dir, steps=5, groups_per_step=1))
    fake_router.loading.clear()
    fake_router.delay_s = 3.0
    stream.append(rollout_group(load_policy(model_dir), run_id, 0, 0))
    assert fake_router.loading.wait(30), "the step did not reach its weight load"


def answers_ask_again_in_time(call: Callable[[], object]) -> None:
    """`call` (2 s deadline) gets the trainer's own 'ask again' before its deadline: no handler thread waits on
    for a caller that left."""
    asked = time.monotonic()
    with pytest.raises(grpc.RpcError) as early:
        call()
    assert early.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ask again" in (early.value.details() or ""), early.value.details()
    assert time.monotonic() - asked < 2


def test_a_stop_mid_step_answers_before_the_callers_deadline_and_the_run_stops_after_the_step(
    core: TrainerCore, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: Any
) -> None:
    in_weight_load(core, small_model_dir, SampleStream(redis_client, "s", prefix=redis_prefix), fake_router)
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            answers_ask_again_in_time(lambda: stub.StopRun(StopRunRequest(run_id="s"), timeout=2))
            stopped = stub.StopRun(StopRunRequest(run_id="s"), timeout=30)
            assert (stopped.state, stopped.step, stopped.groups_trained) == (STOPPED, 1, 1)  # the step was finished
            assert stub.StopRun(StopRunRequest(run_id="s"), timeout=10) == stopped  # asking again is harmless
            with pytest.raises(grpc.RpcError) as unknown:
                stub.StopRun(StopRunRequest(run_id="never-started"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        done.set()
    fake_router.delay_s = 0.0
    assert core.start_run("next", spec_for(small_model_dir, steps=1, groups_per_step=1)).state == TRAINING


def test_a_checkpoint_mid_step_answers_before_the_callers_deadline_and_is_taken_after_the_step(
    core: TrainerCore, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: Any
) -> None:
    """Checkpoint calls whose callers left must not keep handler threads for checkpoint_timeout_s: a few of
    them would take every worker asyncio.to_thread has, and a StopRun could not answer."""
    in_weight_load(core, small_model_dir, SampleStream(redis_client, "c", prefix=redis_prefix), fake_router)
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            answers_ask_again_in_time(lambda: stub.Checkpoint(CheckpointRequest(run_id="c"), timeout=2))
    finally:
        done.set()
    wait_for(lambda: core.status("c").checkpoint_step == 1, timeout=30)  # the request stood
    fake_router.delay_s = 0.0


def test_a_stop_during_start_run_ends_the_run_once_it_is_loaded(
    core: TrainerCore, small_model_dir: Path, fake_router: Any
) -> None:
    fake_router.delay_s = 1.5  # StartRun makes the fleet serve version 0 first
    answers: list[TrainerStatus] = []
    starting = threading.Thread(
        target=lambda: answers.append(core.start_run("late", spec_for(small_model_dir, steps=5, groups_per_step=1)))
    )
    starting.start()
    try:
        assert fake_router.loading.wait(30), "StartRun did not reach its weight load"
        held = core.held()
        assert (held.run_id, held.state) == ("late", STARTING)
        stopped = core.stop_run("late", timeout_s=30)
    finally:
        starting.join(timeout=30)
    assert stopped.state == STOPPED and [a.state for a in answers] == [STOPPED]
    assert core.held() == TrainerStatus(state=IDLE)
    wait_for(lambda: core.status("late").state == STOPPED, timeout=5)
    fake_router.delay_s = 0.0
    assert core.start_run("after", spec_for(small_model_dir, steps=1, groups_per_step=1)).state == TRAINING


def test_checkpoint_and_watch_steps_without_a_run_id_name_the_missing_field(core: TrainerCore) -> None:
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            calls = {
                "Checkpoint": lambda: stub.Checkpoint(CheckpointRequest(), timeout=10),
                "WatchSteps": lambda: next(stub.WatchSteps(WatchStepsRequest(), timeout=10)),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert refused.value.details() == "run_id must be set", name
    finally:
        done.set()
