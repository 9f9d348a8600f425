"""Calls that wait (Checkpoint, StopRun) must not take the threads the orchestrator's StopRun needs. They ran in
asyncio's default pool (cpus + 4 threads: 6 on two cores), and a call without a deadline waited StopRun's 300 s or
--checkpoint-timeout-s: a handful of them (grpcurl, a script) took every thread, and the orchestrator's StopRun
ended in gRPC's own DEADLINE_EXCEEDED, its stop never recorded. Now the servicer has threads of its own, a call
without a deadline waits at most NO_DEADLINE_WAIT_S, and a stop (or a checkpoint) is recorded before the call
waits for a thread, so it stands and its caller hears "ask again" in time even when every thread is busy."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from rlfleet.sample_stream import SampleStream
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import CheckpointRequest, StopRunRequest, TrainerState
from rlfleet_trainer import grpc_server
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.trainer_core import TrainerCore

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import rollout_group, serve_grpc, spec_for, wait_for  # noqa: E402

STOPPED = TrainerState.TRAINER_STATE_STOPPED
DEFAULT_POOL = min(32, (os.cpu_count() or 1) + 4)
"""The threads of asyncio's default pool, which the handlers used."""
WEIGHT_LOAD_S = 4.0


def in_slow_step(core: TrainerCore, model_dir: Path, client: redis.Redis, prefix: str, fake_router: Any) -> None:
    """Run "s" in its first step's weight load, which takes WEIGHT_LOAD_S."""
    core.start_run("s", spec_for(model_dir, steps=5, groups_per_step=1))
    fake_router.loading.clear()
    fake_router.delay_s = WEIGHT_LOAD_S
    SampleStream(client, "s", prefix=prefix).append(rollout_group(load_policy(model_dir), "s", 0, 0))
    assert fake_router.loading.wait(30), "the step did not reach its weight load"


def checkpoints_without_deadline(stub: trainer_pb2_grpc.TrainerStub, calls: int) -> list[threading.Thread]:
    """`calls` Checkpoint calls without a deadline, each waiting for the step in progress to end."""

    def call() -> None:
        try:
            stub.Checkpoint(CheckpointRequest(run_id="s"))
        except grpc.RpcError:
            pass  # the run stopped, or the channel closed: only the threads they held matter here

    threads = [threading.Thread(target=call, daemon=True) for _ in range(calls)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # all of them are in the trainer and waiting
    return threads


def stop_is_answered_in_time_and_stands(stub: trainer_pb2_grpc.TrainerStub, core: TrainerCore) -> None:
    asked = time.monotonic()
    with pytest.raises(grpc.RpcError) as early:
        stub.StopRun(StopRunRequest(run_id="s"), timeout=2)
    assert early.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ask again" in (early.value.details() or ""), early.value.details()  # the trainer's answer, not gRPC's
    assert time.monotonic() - asked < 2
    wait_for(lambda: core.status("s").state == STOPPED, timeout=30)  # the stop stood: the run ends after its step
    assert core.status("s").step == 1


def test_deadline_less_checkpoints_leave_threads_for_a_stop(
    core: TrainerCore, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: Any
) -> None:
    """As many waiting calls as asyncio's default pool had threads."""
    in_slow_step(core, small_model_dir, redis_client, redis_prefix, fake_router)
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            waiting = checkpoints_without_deadline(stub, DEFAULT_POOL)
            stop_is_answered_in_time_and_stands(stub, core)
            for thread in waiting:
                thread.join(timeout=30)
    finally:
        done.set()
        fake_router.delay_s = 0.0


def test_a_stop_stands_and_is_answered_in_time_when_every_handler_thread_is_busy(
    core: TrainerCore,
    small_model_dir: Path,
    redis_client: redis.Redis,
    redis_prefix: str,
    fake_router: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grpc_server, "HANDLER_THREADS", 2)
    in_slow_step(core, small_model_dir, redis_client, redis_prefix, fake_router)
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            waiting = checkpoints_without_deadline(stub, 2)
            stop_is_answered_in_time_and_stands(stub, core)
            for thread in waiting:
                thread.join(timeout=30)
    finally:
        done.set()
        fake_router.delay_s = 0.0
    assert core.status("s").checkpoint_step == 1  # the Checkpoint calls' checkpoint was taken after the step


def test_a_call_without_a_deadline_waits_at_most_no_deadline_wait_s(
    core: TrainerCore,
    small_model_dir: Path,
    redis_client: redis.Redis,
    redis_prefix: str,
    fake_router: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not StopRun's 300 s: a caller without a deadline may have gone long ago."""
    monkeypatch.setattr(grpc_server, "NO_DEADLINE_WAIT_S", 1.0)
    in_slow_step(core, small_model_dir, redis_client, redis_prefix, fake_router)
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            asked = time.monotonic()
            with pytest.raises(grpc.RpcError) as early:
                stub.StopRun(StopRunRequest(run_id="s"))
            assert early.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "ask again" in (early.value.details() or ""), early.value.details()
            assert time.monotonic() - asked < WEIGHT_LOAD_S - 1  # well before the step ended
    finally:
        done.set()
        fake_router.delay_s = 0.0
    wait_for(lambda: core.status("s").state == STOPPED, timeout=30)
