"""StopRun, and Status without a run id, as the orchestrator relies on them to free the trainer of a run
that is over: a stop waits for the step in progress but answers within its caller's deadline (the stop
stands; ask again), a stop during StartRun ends the run as soon as it is loaded, and asking again once
the run has stopped gets the same answer. SIGTERM waits for the step in progress as long as it is told."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from rlfleet.errors import Unavailable
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.sample_stream import SampleStream
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import (
    CheckpointRequest,
    StartRunRequest,
    StatusRequest,
    StopRunRequest,
    TrainerState,
    TrainerStatus,
    WatchStepsRequest,
)
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.run_state import RunStateStore
from rlfleet_trainer.trainer_core import TrainerCore
from rlfleet_trainer.weight_publisher import DiskPublisher

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import rollout_group, serve_grpc, spec_for, wait_for  # noqa: E402

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
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


def test_a_start_of_a_run_asked_to_stop_waits_for_the_stop_and_starts_it_again(
    core: TrainerCore, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: Any
) -> None:
    """A StopRun whose caller gave up, then a StartRun of the same run: answered TRAINING at once, the run then
    stopped at the end of its step, and its caller took it for live while the trainer sat idle."""
    in_weight_load(core, small_model_dir, SampleStream(redis_client, "r", prefix=redis_prefix), fake_router)
    core.request_stop("r")
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    with pytest.raises(Unavailable, match="asked to stop and is finishing its step; .* ask again"):
        core.start_run("r", spec, join_wait_s=0.5)
    fake_router.delay_s = 0.0
    # Started again, from its record (its step trained again: no checkpoint covered it), and it trains on.
    assert core.start_run("r", spec, join_wait_s=30).state == TRAINING
    time.sleep(0.5)
    assert core.status("r").state == TRAINING


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


def test_a_stop_while_the_start_waits_for_the_previous_runs_release_ends_the_run(
    core: TrainerCore, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start waiting for the previous run to let go (closing its weight sync can take minutes) was seen by nothing:
    Status said IDLE, StopRun answered NotFound and recorded nothing, and the run then loaded and trained."""
    closing = threading.Event()
    monkeypatch.setattr(DiskPublisher, "close", lambda self: closing.wait(30))
    core.start_run("first", spec_for(small_model_dir, steps=2, groups_per_step=1))
    core.request_stop("first")
    wait_for(lambda: core.status("first").state == STOPPED, timeout=30)
    answers: list[TrainerStatus] = []
    starting = threading.Thread(
        target=lambda: answers.append(core.start_run("next", spec_for(small_model_dir, steps=2, groups_per_step=1)))
    )
    starting.start()
    try:
        wait_for(lambda: core.held().run_id == "next", timeout=10)  # while "first" still lets go
        assert not closing.is_set() and core.status("next").state == STARTING
        threading.Timer(0.5, closing.set).start()
        stopped = core.stop_run("next", timeout_s=30)
    finally:
        closing.set()
        starting.join(timeout=30)
    assert stopped.state == STOPPED and [a.state for a in answers] == [STOPPED]
    assert core.held() == TrainerStatus(state=IDLE)


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
            # Before, a step below 0 was taken as given: every report from the run's first on.
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.WatchSteps(WatchStepsRequest(run_id="r", from_step=-5), timeout=10))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == "from_step: must be >= 0 (0 starts with the next step), got -5"
    finally:
        done.set()


@pytest.mark.parametrize("run_id", ["x" * 100_000, "../x"])
def test_every_call_refuses_a_run_id_no_run_can_have_naming_the_field(core: TrainerCore, run_id: str) -> None:
    """Before, an oversized id was quoted whole in the refusal, which outgrew a gRPC status: the caller heard
    RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit"), and Status or StopRun of "../x" NOT_FOUND."""
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            calls = {
                "StartRun": lambda: stub.StartRun(StartRunRequest(run_id=run_id, spec=RunSpec()), timeout=10),
                "Status": lambda: stub.Status(StatusRequest(run_id=run_id), timeout=10),
                "StopRun": lambda: stub.StopRun(StopRunRequest(run_id=run_id), timeout=10),
                "Checkpoint": lambda: stub.Checkpoint(CheckpointRequest(run_id=run_id), timeout=10),
                "WatchSteps": lambda: next(stub.WatchSteps(WatchStepsRequest(run_id=run_id), timeout=10)),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, refused.value.code())
                details = refused.value.details()
                assert details.startswith("run_id ") and "must be 1 to 128 letters" in details, name
                assert len(details) < 400, (name, len(details))
    finally:
        done.set()


def test_start_run_without_a_spec_names_the_spec(core: TrainerCore) -> None:
    """Before, it was refused for the empty spec's first field, model.path, which the caller had never sent."""
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
            trainer_pb2_grpc.TrainerStub(channel).StartRun(StartRunRequest(run_id="a"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("spec must be set")
    finally:
        done.set()


@pytest.mark.e2e
@pytest.mark.parametrize(("bound_s", "checkpointed"), [(60.0, True), (1.0, False)])
def test_sigterm_waits_for_the_step_in_progress_up_to_shutdown_timeout_s(
    tmp_path: Path,
    small_model_dir: Path,
    redis_client: redis.Redis,
    redis_prefix: str,
    fake_router: Any,
    bound_s: float,
    checkpointed: bool,
) -> None:
    """`serve` on SIGTERM stops its run after the step in progress and checkpoints it, waiting up to
    --shutdown-timeout-s: a fixed 30 s abandoned a longer step (a GPU step and its weight sync) without its
    checkpoint, though the chart gives the pod 300 s. Here the step's weight load takes 6 s."""
    grpc_port, http_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "rlfleet_trainer", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--http-port", str(http_port), "--router-url", fake_router.url, "--redis-url", REDIS_URL,
        "--redis-prefix", redis_prefix, "--work-dir", str(tmp_path / "work"), "--read-block-ms", "100",
        "--shutdown-timeout-s", str(bound_s),
    ]  # fmt: skip
    trainer = ServiceProcess("trainer", argv, tmp_path / "trainer.log", env={"OMP_NUM_THREADS": "1"})
    try:
        trainer.wait_healthy(f"http://127.0.0.1:{http_port}/health", 90)
        spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            trainer_pb2_grpc.TrainerStub(channel).StartRun(StartRunRequest(run_id="t", spec=spec), timeout=90)
        fake_router.loading.clear()
        fake_router.delay_s = 6.0
        group = rollout_group(load_policy(small_model_dir), "t", 0, 0)
        SampleStream(redis_client, "t", prefix=redis_prefix).append(group)
        assert fake_router.loading.wait(60), "the step did not reach its weight load"
        signalled = time.monotonic()
        os.kill(trainer.pid, signal.SIGTERM)
        code = trainer.proc.wait(timeout=90)
        took = time.monotonic() - signalled
    finally:
        trainer.stop(timeout=10)
    assert code == 0, trainer.log_tail(40)
    record = RunStateStore(redis_client, redis_prefix).load("t")
    if checkpointed:
        assert record is not None and record.step == 1, trainer.log_tail(40)  # the step, then its checkpoint
    else:
        assert record is None and took < 5, (record, took)  # gone at its bound; the step is retrained on restart
