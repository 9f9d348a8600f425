"""TrainerCore end to end on one process: real Redis stream, real tiny model, weights over HTTP, and
its gRPC servicer."""

from __future__ import annotations

import errno
import logging
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import generate_latest
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from rlfleet.errors import Conflict, InvalidInput, NotFound, Unavailable
from rlfleet.sample_stream import SampleStream
from rlfleet.tiny_model import TinyModelConfig, create_tiny_model
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import TrainerState
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.stream_lag import stream_lag
from rlfleet_trainer.trainer_core import TrainerCore

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import rollout_group, serve_grpc, spec_for, wait_for  # noqa: E402


def test_trains_publishes_and_acknowledges(core, small_model_dir, redis_client, redis_prefix, fake_router) -> None:
    status = core.start_run("r1", spec_for(small_model_dir, steps=2, groups_per_step=2))
    assert status.state == TrainerState.TRAINER_STATE_TRAINING and status.weight_version == 0
    assert fake_router.loads == [{"model_path": str(small_model_dir), "weight_version": "0"}]

    stream = SampleStream(redis_client, "r1", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    for i in range(2):
        stream.append(rollout_group(model, "r1", 0, i))
    wait_for(lambda: core.status("r1").weight_version == 1)
    [report] = core.reports("r1", 1)[0]
    assert report.metrics["logprob_diff"] < 1e-5  # same weights, same tokens: train == rollout
    assert report.groups == 2 and report.metrics["grad_norm"] > 0

    new_model = load_policy(core.status("r1").weights_path)
    for i in range(2):
        stream.append(rollout_group(new_model, "r1", 1, i))
    wait_for(lambda: core.status("r1").state == TrainerState.TRAINER_STATE_STOPPED)
    final = core.status("r1")
    assert (final.step, final.weight_version, final.groups_trained) == (2, 2, 4)
    assert [load["weight_version"] for load in fake_router.loads] == ["0", "1", "2"]
    assert Path(fake_router.loads[-1]["model_path"], "model.safetensors").exists()
    assert stream.pending_count() == 0
    before = load_policy(small_model_dir).state_dict()
    after = load_policy(final.weights_path).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # Once the run has ended its step values are gone (NaN), not the last step's passed off as live; its position stays.
    sample = core.metrics.registry.get_sample_value
    wait_for(lambda: math.isnan(sample("rlfleet_trainer_tokens_per_second") or 0.0))
    assert math.isnan(sample("rlfleet_trainer_loss") or 0.0) and sample("rlfleet_trainer_step") == 2
    # A follower of WatchSteps away when the run ended, and the next run started, still gets its last steps: they
    # went with the run's object, and the stream ended empty.
    wait_for(lambda: not core._runs["r1"].releasing)
    core.start_run("r1-next", spec_for(small_model_dir, steps=1, groups_per_step=1))
    assert [r.step for r in core.reports("r1", 2)[0]] == [2] and core.reports("r1", 1)[1]


def test_a_status_at_a_step_has_that_steps_report(
    core, small_model_dir, redis_client, redis_prefix, monkeypatch
) -> None:
    # The work after a step (pruning old weight versions) is slowed: a reader that sees the run at step 1 in Status
    # must find step 1's report (WatchSteps) already, not after that work.
    from rlfleet_trainer import run_loop

    prune = run_loop.prune_versions

    def slow_prune(*args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)
        prune(*args, **kwargs)

    monkeypatch.setattr(run_loop, "prune_versions", slow_prune)
    core.start_run("r1", spec_for(small_model_dir, steps=1, groups_per_step=1))
    SampleStream(redis_client, "r1", prefix=redis_prefix).append(
        rollout_group(load_policy(small_model_dir), "r1", 0, 0)
    )
    wait_for(lambda: core.status("r1").weight_version == 1)
    assert [r.step for r in core.reports("r1", 1)[0]] == [1]


def test_graceful_shutdown_checkpoints_and_a_restart_resumes_from_it(
    tmp_path, small_model_dir, redis_client, redis_prefix, fake_router, caplog
) -> None:
    settings = TrainerSettings(redis_prefix=redis_prefix, work_dir=tmp_path / "trainer", read_block_ms=100)
    first = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    spec = spec_for(small_model_dir, steps=2, groups_per_step=1)
    first.start_run("r2", spec)
    stream = SampleStream(redis_client, "r2", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    stream.append(rollout_group(model, "r2", 0, 0))
    wait_for(lambda: first.status("r2").weight_version == 1)
    assert stream.pending_count() == 1  # a step acknowledges nothing; a checkpoint does
    first.shutdown()
    assert first.status("r2").checkpoint_step == 1 and stream.pending_count() == 0

    # A group delivered to the old process but never acknowledged must be trained by the new one.
    stream.append(rollout_group(model, "r2", 1, 0))
    stream.read(settings.consumer, count=1)
    second = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    with pytest.raises(NotFound):
        second.status("r2")
    # A checkpoint its record does not name (Redis restored from an older snapshot) was deleted at the resume.
    later = settings.work_dir / "runs" / "r2" / "checkpoints" / "step_7"
    later.mkdir()
    (later / "__0_0.distcp").write_text("shard of step 7")
    loads_before = len(fake_router.loads)
    second.start_run("r2", spec)
    (aside,) = later.parent.parent.glob("checkpoints.unrecorded-*")
    assert (aside / "step_7" / "__0_0.distcp").read_text() == "shard of step 7" and not later.exists()
    assert "resumes from step 1, its record's, but" in caplog.text and "later steps 7" in caplog.text
    resumed_load = fake_router.loads[loads_before]  # before the run's thread starts: the version it resumes from
    assert resumed_load["weight_version"] == "1" and resumed_load["model_path"].endswith("/weights/v1")
    wait_for(lambda: second.status("r2").state == TrainerState.TRAINER_STATE_STOPPED)
    final = second.status("r2")
    assert (final.groups_trained, final.checkpoint_step) == (2, 2)  # the schedule's end checkpoints
    assert stream.pending_count() == 0
    second.shutdown()


def test_one_run_at_a_time_and_bad_specs(core, small_model_dir, tmp_path) -> None:
    with pytest.raises(InvalidInput, match="model.path"):
        core.start_run("bad", spec_for(tmp_path / "missing", steps=1, groups_per_step=1))
    core.start_run("a", spec_for(small_model_dir, steps=5, groups_per_step=1))
    assert core.start_run("a", spec_for(small_model_dir, steps=5, groups_per_step=1)).run_id == "a"
    with pytest.raises(Conflict, match="busy with run a"):
        core.start_run("b", spec_for(small_model_dir, steps=1, groups_per_step=1))
    stopped = core.stop_run("a")
    assert stopped.state == TrainerState.TRAINER_STATE_STOPPED and stopped.step == 0
    core.start_run("b", spec_for(small_model_dir, steps=1, groups_per_step=1))
    with pytest.raises(NotFound):
        core.status("never")


def test_a_run_that_starts_shows_no_step_values_of_the_run_before(core, small_model_dir) -> None:
    core.metrics.step.set(7)
    core.metrics.checkpoint_step.set(5)
    core.metrics.observe_step({"loss": 0.25, "reward_mean": 0.5})
    core.start_run("next", spec_for(small_model_dir, steps=5, groups_per_step=1))
    try:
        sample = core.metrics.registry.get_sample_value
        assert (sample("rlfleet_trainer_step"), sample("rlfleet_trainer_checkpoint_step")) == (0, 0)
        assert math.isnan(sample("rlfleet_trainer_loss")) and math.isnan(sample("rlfleet_trainer_reward_mean"))
    finally:
        core.stop_run("next")


def test_a_fresh_start_over_checkpoints_without_a_record_keeps_them_aside(
    core, small_model_dir, fake_router, caplog
) -> None:
    """Redis lost the run's record (emptied, an old snapshot, another prefix) while its checkpoints stayed on disk.
    Before, the run started from step 0 without a word, and its first checkpoint deleted every later one."""
    root = core.settings.work_dir / "runs" / "lost" / "checkpoints"
    for step in (2, 3):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "__0_0.distcp").write_text(f"shard of step {step}")
    status = core.start_run("lost", spec_for(small_model_dir, steps=1, groups_per_step=1))
    assert status.step == 0
    (aside,) = root.parent.glob("checkpoints.unrecorded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_2", "step_3"]
    assert (aside / "step_3" / "__0_0.distcp").read_text() == "shard of step 3"
    assert not root.exists() or not any(root.iterdir())
    assert "has no record in Redis but checkpoints of steps 2, 3" in caplog.text
    core.stop_run("lost")


def test_router_refusal_fails_the_start(core, small_model_dir, fake_router) -> None:
    fake_router.fail_next = 100
    core.router.timeout_s = 1.0
    with pytest.raises(Exception, match="did not load weight version 0"):
        core.start_run("r3", spec_for(small_model_dir, steps=1, groups_per_step=1))


def test_a_failed_start_leaves_no_policy_loaded(core, small_model_dir, fake_router) -> None:
    """On a GPU the model, its optimizer and the reference would stay pinned until the next start."""
    fake_router.page_status = 404  # router_url names something else: not a JSON decoding error
    with pytest.raises(Conflict, match="router_url"):
        core.start_run("r4", spec_for(small_model_dir, steps=1, groups_per_step=1))
    assert core.ranks.state.policy is None
    assert core.held().state == TrainerState.TRAINER_STATE_IDLE


def disk_full(*args: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_that_cannot_be_written_fails_the_run(
    core, small_model_dir, redis_client, redis_prefix, monkeypatch
) -> None:
    """DCP wraps a full disk in its CheckpointException, a BaseException: the run must fail naming the
    cause, not lose its training thread while it says it trains and holds the trainer for good."""
    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    spec = spec_for(small_model_dir, steps=3, groups_per_step=1)
    spec.trainer.checkpoint_every = 1
    core.start_run("full", spec)
    SampleStream(redis_client, "full", prefix=redis_prefix).append(
        rollout_group(load_policy(small_model_dir), "full", 0, 0)
    )
    wait_for(lambda: core.status("full").state != TrainerState.TRAINER_STATE_TRAINING)
    failed = core.status("full")
    assert failed.state == TrainerState.TRAINER_STATE_FAILED and failed.checkpoint_step == 0
    assert "No space left on device" in failed.error, failed.error
    assert core.reports("full", 1) == ([], True)  # WatchSteps ends
    assert core.ranks.state.policy is None
    monkeypatch.undo()
    assert (
        core.start_run("next", spec_for(small_model_dir, steps=1, groups_per_step=1)).state
        == TrainerState.TRAINER_STATE_TRAINING
    )


def test_a_resume_whose_checkpoint_does_not_fit_or_cannot_be_read_is_refused_with_the_cause(
    core, small_model_dir, redis_client, redis_prefix, monkeypatch, tmp_path
) -> None:
    spec = spec_for(small_model_dir, steps=1, groups_per_step=1)
    core.start_run("o", spec)
    SampleStream(redis_client, "o", prefix=redis_prefix).append(rollout_group(load_policy(small_model_dir), "o", 0, 0))
    wait_for(lambda: core.status("o").state == TrainerState.TRAINER_STATE_STOPPED)
    assert core.status("o").checkpoint_step == 1
    other = tmp_path / "other"
    create_tiny_model(other, TinyModelConfig(hidden_size=32, layers=2, heads=4, kv_heads=2))
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            with pytest.raises(grpc.RpcError) as mismatch:
                stub.StartRun(trainer_pb2.StartRunRequest(run_id="o", spec=spec_for(other, 2, 1)), timeout=60)
            assert mismatch.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"model.path {other}" in (mismatch.value.details() or "")
            assert "Size mismatch" in (mismatch.value.details() or "")
            assert core.ranks.state.policy is None and core.held().state == TrainerState.TRAINER_STATE_IDLE

            monkeypatch.setattr(FileSystemReader, "read_data", lambda *args: disk_full())
            with pytest.raises(grpc.RpcError) as unreadable:
                stub.StartRun(trainer_pb2.StartRunRequest(run_id="o", spec=spec), timeout=60)
            assert unreadable.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "No space left on device" in (unreadable.value.details() or "")
            assert core.ranks.state.policy is None and core.held().state == TrainerState.TRAINER_STATE_IDLE
            monkeypatch.undo()

            # Damage no retry mends: before, a missing shard was UNAVAILABLE (asked again for ever), a truncated or
            # overwritten one "does not fit that model (the run was trained from another one)".
            (shard,) = Path(core.status("o").checkpoint_path).glob("*.distcp")
            whole = shard.read_bytes()
            for damage in ("truncated", "cut short", "overwritten", "missing"):
                if damage == "truncated":
                    shard.write_bytes(whole[: len(whole) // 2])
                elif damage == "cut short":  # EOFError
                    shard.write_bytes(whole[:100])
                elif damage == "overwritten":  # no pickle where one should be
                    shard.write_bytes(b"\xff" * 4096 + whole[4096:])
                else:
                    shard.unlink()
                with pytest.raises(grpc.RpcError) as damaged:
                    stub.StartRun(trainer_pb2.StartRunRequest(run_id="o", spec=spec), timeout=60)
                assert damaged.value.code() == grpc.StatusCode.FAILED_PRECONDITION, damage
                details = damaged.value.details() or ""
                assert f"its checkpoint {core.status('o').checkpoint_path} is damaged" in details, details
                assert "start the run under a new id" in details and "another one" not in details, details
                assert core.ranks.state.policy is None and core.held().state == TrainerState.TRAINER_STATE_IDLE
    finally:
        done.set()


def test_checkpoint_call_commits_the_groups_and_a_stop_without_one_keeps_them_pending(
    core, small_model_dir, redis_client, redis_prefix
) -> None:
    core.start_run("c", spec_for(small_model_dir, steps=5, groups_per_step=1))
    stream = SampleStream(redis_client, "c", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    for i in range(2):
        stream.append(rollout_group(model, "c", 0, i))
    wait_for(lambda: core.status("c").weight_version == 2)
    assert stream.pending_count() == 2 and core.store.load("c") is None

    taken = core.checkpoint("c")  # the trainer is waiting for groups: it checkpoints at once
    assert (taken.step, taken.weight_version) == (2, 2) and Path(taken.path, ".metadata").exists()
    assert stream.pending_count() == 0
    record = core.store.load("c")
    assert record is not None and (record.step, record.checkpoint_path, record.groups_trained) == (2, taken.path, 2)
    assert core.checkpoint("c") == taken  # nothing trained since: the same checkpoint
    exported = generate_latest(core.metrics.registry).decode()
    assert "rlfleet_trainer_checkpoint_step 2.0" in exported
    assert "rlfleet_trainer_checkpoint_seconds_count 1.0" in exported

    stream.append(rollout_group(model, "c", 2, 0))
    wait_for(lambda: core.status("c").weight_version == 3)
    stopped = core.stop_run("c")
    assert (stopped.step, stopped.checkpoint_step) == (3, 2)
    assert stream.pending_count() == 1  # trained, but no checkpoint covers it
    with pytest.raises(Conflict, match="without a checkpoint of it"):
        core.checkpoint("c")
    with pytest.raises(Conflict, match="before a checkpoint was asked for"):
        core.stop_run("c", checkpoint=True)


def test_grpc_resume_checkpoint_and_stop_with_checkpoint(
    core, small_model_dir, redis_client, redis_prefix, fake_router
) -> None:
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    core.start_run("g", spec)
    stream = SampleStream(redis_client, "g", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    stream.append(rollout_group(model, "g", 0, 0))
    wait_for(lambda: core.status("g").weight_version == 1)
    core.checkpoint("g")
    stream.append(rollout_group(model, "g", 1, 0))
    wait_for(lambda: core.status("g").weight_version == 2)
    core.stop_run("g")  # step 2 is not covered: StartRun goes back to step 1 and trains it again

    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            started = stub.StartRun(trainer_pb2.StartRunRequest(run_id="g", spec=spec), timeout=60)
            assert started.checkpoint_step == 1 and started.checkpoint_path.endswith("/checkpoints/step_1")
            wait_for(lambda: core.status("g").weight_version == 2)
            assert [load["weight_version"] for load in fake_router.loads[-3:]] == ["2", "1", "2"]
            taken = stub.Checkpoint(trainer_pb2.CheckpointRequest(run_id="g"), timeout=60)
            assert (taken.step, taken.weight_version) == (2, 2)
            stream.append(rollout_group(model, "g", 2, 0))
            wait_for(lambda: core.status("g").weight_version == 3)
            stopped = stub.StopRun(trainer_pb2.StopRunRequest(run_id="g", checkpoint=True), timeout=60)
            assert (stopped.state, stopped.step, stopped.checkpoint_step) == (TrainerState.TRAINER_STATE_STOPPED, 3, 3)
            status = stub.Status(trainer_pb2.StatusRequest(run_id="g"), timeout=10)
            assert status.checkpoint_path == str(Path(taken.path).parent / "step_3")
            assert stream.pending_count() == 0
            assert sorted(p.name for p in Path(taken.path).parent.iterdir()) == ["step_2", "step_3"]  # keep 2
    finally:
        done.set()


def test_the_stream_lag_is_read_at_each_scrape_while_the_run_waits_and_is_none_once_it_stopped(
    core, small_model_dir, redis_client, redis_prefix
) -> None:
    """rlfleet_trainer_stream_lag_groups is the active run's backlog as Redis holds it when /metrics is scraped: a
    group appended while the trainer waits for its partner shows at once (set only after a step, the gauge read 0
    at every wait), and a run that stopped has none (NaN), not the value of its last step."""

    def lag() -> float | None:
        return core.metrics.registry.get_sample_value("rlfleet_trainer_stream_lag_groups")

    core.start_run("lag", spec_for(small_model_dir, steps=3, groups_per_step=2))
    stream = SampleStream(redis_client, "lag", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    for i in range(2):
        stream.append(rollout_group(model, "lag", 0, i))
    wait_for(lambda: core.status("lag").weight_version == 1)
    assert lag() == 0
    stream.append(rollout_group(model, "lag", 1, 0))  # the trainer waits for a second group
    assert lag() == 1
    assert "rlfleet_trainer_stream_lag_groups 1.0" in generate_latest(core.metrics.registry).decode()
    stopped = core.stop_run("lag")
    assert stopped.state == TrainerState.TRAINER_STATE_STOPPED
    value = lag()
    assert value is not None and math.isnan(value)


def test_an_untrainable_group_on_the_stream_is_set_aside_and_the_run_goes_on(
    core, small_model_dir, redis_client, redis_prefix
) -> None:
    """A group another writer put on the stream without the producer's checks (per-token lists of the
    wrong length, a NaN log-prob) would fail every step that holds it, after every resume too."""
    core.start_run("m", spec_for(small_model_dir, steps=1, groups_per_step=2))
    stream = SampleStream(redis_client, "m", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    short_mask, nan_logprob = rollout_group(model, "m", 0, 0), rollout_group(model, "m", 0, 1)
    short_mask.samples[0].loss_mask.pop()
    nan_logprob.samples[1].rollout_logprobs[0] = float("nan")
    for bad in (short_mask, nan_logprob):
        redis_client.xadd(stream.key, {"group_id": bad.group_id, "group": bad.SerializeToString()})
    for i in (2, 3):
        stream.append(rollout_group(model, "m", 0, i))
    wait_for(lambda: core.status("m").state != TrainerState.TRAINER_STATE_TRAINING)
    final = core.status("m")
    assert (final.state, final.step, final.groups_trained) == (TrainerState.TRAINER_STATE_STOPPED, 1, 2), final.error
    reasons = [reason for _, reason in stream.dead_letters()]
    assert len(reasons) == 2 and "loss_mask" in reasons[0] and "rollout_logprobs" in reasons[1], reasons
    assert stream.pending_count() == 0
    assert stream_lag(stream, final.groups_trained) == 0  # the groups set aside are no backlog
    assert all(torch.isfinite(t).all() for t in load_policy(final.weights_path).state_dict().values())


def test_a_group_with_a_token_outside_the_models_vocabulary_is_set_aside_and_the_run_goes_on(
    core, small_model_dir, redis_client, redis_prefix
) -> None:
    """The producer cannot know the model's vocabulary, so such a group is appended; trained on, it failed the
    step with an IndexError in the model, and the run at every resume, as it was never set aside."""
    core.start_run("v", spec_for(small_model_dir, steps=1, groups_per_step=1))
    stream = SampleStream(redis_client, "v", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    vocab_size = model.config.vocab_size
    bad = rollout_group(model, "v", 0, 0)
    bad.samples[1].response_token_ids[0] = vocab_size
    bad_id = stream.append(bad)
    stream.append(rollout_group(model, "v", 0, 1))
    wait_for(lambda: core.status("v").state != TrainerState.TRAINER_STATE_TRAINING)
    final = core.status("v")
    assert (final.state, final.step, final.groups_trained) == (TrainerState.TRAINER_STATE_STOPPED, 1, 1), final.error
    reason = f"samples[1].response_token_ids[0] is {vocab_size}, outside the vocabulary [0, {vocab_size})"
    [(entry, why)] = stream.lost_groups()  # the orchestrator fails the run, naming it, rather than wait it out
    assert entry == bad_id and why.startswith("untrainable: ") and why.endswith(reason), why
    assert stream.pending_count() == 0


@pytest.mark.parametrize("run_id", ["../escape", "a/b", "..", ".hidden", "run 1"])
def test_a_run_id_that_is_not_one_plain_name_is_refused(core, small_model_dir, tmp_path, run_id) -> None:
    """The run id names the run's directory under the work dir: "../escape" would write outside it, "a/../b"
    into another run's."""
    with pytest.raises(InvalidInput, match="run_id"):
        core.start_run(run_id, spec_for(small_model_dir, steps=1, groups_per_step=1))
    assert core.held().state == TrainerState.TRAINER_STATE_IDLE
    assert not (tmp_path / "escape").exists()


def test_a_relative_work_dir_gives_the_router_and_the_record_absolute_paths(
    tmp_path, monkeypatch, small_model_dir, redis_client, redis_prefix, fake_router
) -> None:
    """The engines and a restarted trainer need not share this process's working directory."""
    monkeypatch.chdir(tmp_path)
    settings = TrainerSettings(redis_prefix=redis_prefix, work_dir=Path("trainer"), read_block_ms=100)
    core = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    try:
        core.start_run("rel", spec_for(small_model_dir, steps=1, groups_per_step=1))
        stream = SampleStream(redis_client, "rel", prefix=redis_prefix)
        stream.append(rollout_group(load_policy(small_model_dir), "rel", 0, 0))
        wait_for(lambda: core.status("rel").state == TrainerState.TRAINER_STATE_STOPPED)
    finally:
        core.shutdown()
    assert fake_router.loads[-1]["model_path"] == str(tmp_path / "trainer" / "runs" / "rel" / "weights" / "v1")
    record = core.store.load("rel")
    assert record is not None and record.checkpoint_path == str(tmp_path / "trainer/runs/rel/checkpoints/step_1")


def test_a_relative_model_path_reaches_the_router_as_the_absolute_path_the_trainer_loaded(
    core, small_model_dir, fake_router, monkeypatch
) -> None:
    """Before, version 0's path went to the router, and through it to every engine, as given: relative to
    whatever directory each engine runs in, a model of that name there or none."""
    monkeypatch.chdir(small_model_dir.parent)
    core.start_run("relm", spec_for(Path(small_model_dir.name), steps=1, groups_per_step=1))
    assert fake_router.loads[-1]["model_path"] == str(small_model_dir)
    assert core.status("relm").weights_path == str(small_model_dir)
    core.stop_run("relm")


def test_start_run_asked_again_while_the_run_starts_answers_with_that_start(core, small_model_dir, fake_router) -> None:
    """An orchestrator that restarted, or timed out, during a long StartRun (a large policy to load) asks
    again: the trainer is not "busy with" the very run it is starting."""
    fake_router.delay_s = 1.5  # StartRun makes the fleet serve version 0 first
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    first: list[trainer_pb2.TrainerStatus] = []
    starting = threading.Thread(target=lambda: first.append(core.start_run("slow", spec)))
    starting.start()
    try:
        assert fake_router.loading.wait(30), "StartRun did not reach its weight load"
        again = core.start_run("slow", spec)
    finally:
        starting.join(timeout=30)
    assert again.run_id == "slow" and again.state == TrainerState.TRAINER_STATE_TRAINING
    assert [s.state for s in first] == [TrainerState.TRAINER_STATE_TRAINING]
    assert fake_router.loads.count(fake_router.loads[0]) == 1  # one start, not two
    with pytest.raises(Conflict, match="busy with run slow"):
        core.start_run("other", spec)


def test_a_starting_run_is_known_by_name(core, small_model_dir, fake_router, redis_client, redis_prefix) -> None:
    """Status() names the run STARTING, so the calls that name it must find it too (not "StartRun resumes it")."""
    fake_router.delay_s = 4.0  # StartRun makes the fleet serve version 0 first
    spec = spec_for(small_model_dir, steps=1, groups_per_step=1)
    starting = threading.Thread(target=lambda: core.start_run("s", spec))
    starting.start()
    port, done = serve_grpc(core)
    watched: list[int] = []
    try:
        assert fake_router.loading.wait(30), "StartRun did not reach its weight load"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            status = stub.Status(trainer_pb2.StatusRequest(run_id="s"), timeout=10)
            assert (status.run_id, status.state) == ("s", TrainerState.TRAINER_STATE_STARTING)
            with pytest.raises(grpc.RpcError) as checkpoint:
                stub.Checkpoint(trainer_pb2.CheckpointRequest(run_id="s"), timeout=10)
            assert checkpoint.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "starting" in (checkpoint.value.details() or "")
            asked = time.monotonic()
            with pytest.raises(grpc.RpcError) as again:  # the join waits for the start within the caller's deadline
                stub.StartRun(trainer_pb2.StartRunRequest(run_id="s", spec=spec), timeout=2)
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE and "ask again" in (again.value.details() or "")
            assert time.monotonic() - asked < 2
            stream = stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id="s"), timeout=60)
            watcher = threading.Thread(target=lambda: watched.extend(report.step for report in stream))
            watcher.start()
            starting.join(timeout=30)
            assert core.status("s").state == TrainerState.TRAINER_STATE_TRAINING
            stream_of_s = SampleStream(redis_client, "s", prefix=redis_prefix)
            stream_of_s.append(rollout_group(load_policy(small_model_dir), "s", 0, 0))
            watcher.join(timeout=30)
            assert not watcher.is_alive() and watched == [1]  # its step, then the end of the run
    finally:
        done.set()
        starting.join(timeout=30)


def test_shutdown_during_a_start_stops_the_run_before_it_trains(core, small_model_dir, fake_router) -> None:
    """SIGTERM while StartRun loads: no training thread may outlive the shutdown (the ranks stop after it), and the
    call waiting for the start hears of the shutdown at once, not once the fleet has loaded."""
    fake_router.delay_s = 1.5
    answers: list[trainer_pb2.TrainerStatus | Exception] = []

    def start() -> None:
        try:
            answers.append(core.start_run("q", spec))
        except Unavailable as exc:
            answers.append(exc)

    spec = spec_for(small_model_dir, steps=3, groups_per_step=1)
    starting = threading.Thread(target=start)
    starting.start()
    try:
        assert fake_router.loading.wait(30), "StartRun did not reach its weight load"
        stopping = threading.Thread(target=core.shutdown, kwargs={"timeout_s": 30})
        stopping.start()
        starting.join(timeout=1.0)
        assert [str(a) for a in answers] == [
            "the trainer is shutting down; run q was still starting and does not start here: ask again once the "
            "trainer is back (the run resumes from its last checkpoint)"
        ]
        stopping.join(timeout=30)
        # Once shutdown returns, the start has ended without training.
        assert core.status("q").state == TrainerState.TRAINER_STATE_STOPPED and core.ranks.state.policy is None
        assert not [t for t in threading.enumerate() if t.name == "train-q"]
    finally:
        starting.join(timeout=30)
    with pytest.raises(Unavailable, match="shutting down"):
        core.start_run("r", spec)


def test_watch_steps_from_the_next_step_during_a_resumed_start_begins_after_the_step_it_resumes_from(
    core, small_model_dir, redis_client, redis_prefix, fake_router
) -> None:
    """from_step 0 starts with the next step. Asked while a run stopped at step 2 started again in the same trainer,
    it began at step 1: the watcher got steps 1 and 2, the reports the resumed run keeps, as if just taken."""
    spec = spec_for(small_model_dir, steps=4, groups_per_step=1)
    spec.trainer.checkpoint_every = 1
    stream = SampleStream(redis_client, "w", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    core.start_run("w", spec)
    for i in range(2):
        stream.append(rollout_group(model, "w", i, 0))
    wait_for(lambda: core.status("w").checkpoint_step == 2)
    assert core.stop_run("w").state == TrainerState.TRAINER_STATE_STOPPED
    wait_for(lambda: not core._runs["w"].releasing)
    fake_router.loading.clear()
    fake_router.delay_s = 1.5  # the resumed start makes the fleet serve version 2 first
    starting = threading.Thread(target=lambda: core.start_run("w", spec))
    starting.start()
    port, done = serve_grpc(core)
    watched: list[int] = []
    try:
        assert fake_router.loading.wait(30), "StartRun did not reach its weight load"
        assert core.status("w").state == TrainerState.TRAINER_STATE_STARTING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reports = trainer_pb2_grpc.TrainerStub(channel).WatchSteps(
                trainer_pb2.WatchStepsRequest(run_id="w"), timeout=60
            )
            watcher = threading.Thread(target=lambda: watched.extend(report.step for report in reports))
            watcher.start()
            starting.join(timeout=30)
            fake_router.delay_s = 0.0
            assert core.status("w").step == 2
            for i in range(2, 4):
                stream.append(rollout_group(model, "w", i, 0))
            watcher.join(timeout=60)
            assert not watcher.is_alive()
    finally:
        done.set()
        starting.join(timeout=30)
    assert watched == [3, 4]  # the steps after the one it resumed from, then the end of the run


def test_a_run_resumed_in_the_same_trainer_keeps_the_reports_of_the_steps_it_resumes_after(
    core, small_model_dir, redis_client, redis_prefix, caplog
) -> None:
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    spec.trainer.checkpoint_every = 1
    core.start_run("again", spec)
    stream = SampleStream(redis_client, "again", prefix=redis_prefix)
    model = load_policy(small_model_dir)
    with caplog.at_level(logging.INFO, logger="rlfleet_trainer.checkpoint_commit"):
        for i in range(2):
            stream.append(rollout_group(model, "again", i, 0))
        wait_for(lambda: core.status("again").checkpoint_step == 2)
    # A save says when it starts and what it wrote: on a large model it takes minutes, which read as a hang.
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("run again: writing the checkpoint of step 2 under ") for m in said), said
    assert any(
        re.match(r"run again: checkpoint of step 2 written, [\d.]+ MB \([\d.]+ MB/s\) in [\d.]+s", m) for m in said
    ), said
    assert core.stop_run("again").state == TrainerState.TRAINER_STATE_STOPPED
    wait_for(lambda: not core._runs["again"].releasing)
    resumed = core.start_run("again", spec)
    assert resumed.step == 2 and [r.step for r in core.reports("again", 1)[0]] == [1, 2]
