"""A run that ends on its own reports STOPPED (or FAILED) before its thread has let go of what it holds: the weight
sync with the fleet (closing a distributed one asks the router, up to minutes) and its policy on the ranks. A run
started in that window loaded its policy, then the old thread's unload threw it away, and the new run failed at its
first step with "no run is loaded on this rank". A start now waits for the release (bounded, then UNAVAILABLE:
ask again), and a run's release never unloads another run's policy."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from rlfleet.errors import Unavailable
from rlfleet.run_spec import resolve
from rlfleet.sample_stream import SampleStream
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import StartRunRequest, TrainerState, TrainerStatus
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.rank_group import RankGroup
from rlfleet_trainer.rank_ops import RANK_OPS, RankState, ShardingOptions
from rlfleet_trainer.run_loop import release_policy
from rlfleet_trainer.trainer_core import TrainerCore
from rlfleet_trainer.weight_publisher import DiskPublisher

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import rollout_group, serve_grpc, spec_for, wait_for  # noqa: E402

TRAINING, STOPPED = TrainerState.TRAINER_STATE_TRAINING, TrainerState.TRAINER_STATE_STOPPED


class SlowRelease:
    """Holds an ended run's thread in its weight sync's close until `release` is set, as closing a distributed
    weight sync through a slow router would (DiskPublisher.close stands in for DistributedPublisher.close)."""

    def __init__(self) -> None:
        self.closing = threading.Event()
        self.release = threading.Event()

    def close(self) -> None:
        """Set as DiskPublisher.close: a bound method, so it is called without the publisher."""
        self.closing.set()
        self.release.wait(60)


@pytest.fixture
def slow_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowRelease]:
    slow = SlowRelease()
    monkeypatch.setattr(DiskPublisher, "close", slow.close)
    yield slow
    slow.release.set()  # never leave a training thread behind


def run_to_its_end(core: TrainerCore, model_dir: Path, client: redis.Redis, prefix: str, slow: SlowRelease) -> None:
    """Run "a" trains its one step and ends on its own; its thread is then held in the release."""
    core.start_run("a", spec_for(model_dir, steps=1, groups_per_step=1))
    SampleStream(client, "a", prefix=prefix).append(rollout_group(load_policy(model_dir), "a", 0, 0))
    assert slow.closing.wait(60), "run a did not end"
    assert core.status("a").state == STOPPED  # what the orchestrator sees before it starts its next run


def test_a_start_right_after_a_run_ended_waits_for_its_release_and_then_trains(
    core: TrainerCore, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, slow_release: SlowRelease
) -> None:
    run_to_its_end(core, small_model_dir, redis_client, redis_prefix, slow_release)
    answers: list[TrainerStatus] = []
    starting = threading.Thread(
        target=lambda: answers.append(core.start_run("b", spec_for(small_model_dir, steps=2, groups_per_step=1)))
    )
    starting.start()
    starting.join(timeout=3)
    assert not answers, "run b started while run a still held its policy"
    slow_release.release.set()
    starting.join(timeout=60)
    assert [a.state for a in answers] == [TRAINING]
    SampleStream(redis_client, "b", prefix=redis_prefix).append(rollout_group(load_policy(small_model_dir), "b", 0, 0))
    wait_for(lambda: core.status("b").step == 1 or core.status("b").state != TRAINING)
    after = core.status("b")
    assert (after.state, after.step, after.error) == (TRAINING, 1, "")
    assert core.ranks.state.policy is not None


def test_a_start_answers_unavailable_while_the_ended_run_is_still_released(
    core: TrainerCore, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, slow_release: SlowRelease
) -> None:
    """UNAVAILABLE, which the orchestrator asks again on, before the caller's deadline; not a start whose policy
    the ended run then unloads."""
    run_to_its_end(core, small_model_dir, redis_client, redis_prefix, slow_release)
    with pytest.raises(Unavailable, match="run a has ended and the trainer is still letting go of it"):
        core.start_run("b", spec_for(small_model_dir, steps=2, groups_per_step=1), join_wait_s=0.2)
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            request = StartRunRequest(run_id="b", spec=spec_for(small_model_dir, steps=2, groups_per_step=1))
            with pytest.raises(grpc.RpcError) as refused:
                stub.StartRun(request, timeout=3)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "ask again" in (refused.value.details() or ""), refused.value.details()
            # The same run asked again has to wait too: its new policy would be the one the old thread unloads.
            with pytest.raises(grpc.RpcError) as same_run:
                stub.StartRun(StartRunRequest(run_id="a", spec=spec_for(small_model_dir, 1, 1)), timeout=3)
            assert same_run.value.code() == grpc.StatusCode.UNAVAILABLE
            slow_release.release.set()
            assert stub.StartRun(request, timeout=60).state == TRAINING
    finally:
        done.set()
    assert core.ranks.state.policy is not None


def test_releasing_a_run_leaves_another_runs_policy_loaded(small_model_dir: Path) -> None:
    ranks = RankGroup(RANK_OPS, RankState(ShardingOptions()))
    spec = resolve(spec_for(small_model_dir, steps=1, groups_per_step=1))
    first = ranks.call("load_run", spec)
    second = ranks.call("load_run", spec)
    release_policy(ranks, "first", first)
    assert ranks.state.policy is second
    release_policy(ranks, "second", second)
    assert ranks.state.policy is None
