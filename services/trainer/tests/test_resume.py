"""A trainer SIGKILLed between checkpoints resumes from the last one, retrains exactly the groups
after it, and ends with the weights of a run that was never interrupted.

The trainer under test is a TrainerCore in a child process (this file run as a script); the groups
come from a seeded generator and go straight onto the run's stream, so both runs see the same data.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
from google.protobuf import json_format

from rlfleet.processes import ServiceProcess
from rlfleet.sample_stream import SampleStream, connect_redis
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet.v1.trainer_pb2 import TrainerState
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.run_state import RunStateStore
from rlfleet_trainer.trainer_core import TrainerCore

STEPS, GROUPS_PER_STEP, CHECKPOINT_EVERY, KILLED_AFTER = 6, 2, 2, 3


def spec_for(model_dir: Path) -> RunSpec:
    """PPO (a critic whose state must survive), a warmup then cosine schedule, a checkpoint every 2 steps."""
    return json_format.ParseDict(
        {
            "model": {"path": str(model_dir)},
            "dataset": {"arithmetic": {}},
            "rollout": {"group_size": 4, "groups_per_step": GROUPS_PER_STEP},
            "reward": {"terms": [{"function": "arith_exact"}]},
            "algorithm": {"name": "ppo"},
            "trainer": {
                "learning_rate": 5e-3,
                "warmup_steps": 2,
                "lr_schedule": "cosine",
                "checkpoint_every": CHECKPOINT_EVERY,
            },
            "schedule": {"steps": STEPS},
        },
        RunSpec(),
    )


def make_groups(model_dir: Path, run_id: str, count: int, seed: int = 7) -> list[SampleGroup]:
    """`count` groups of 4 samples: seeded random prompts and responses, rewards, and the rollout
    log-probs the base model gives them."""
    model = load_policy(model_dir)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(count):
        prompt = torch.randint(10, 40, (5,), generator=gen).tolist()
        samples = []
        for j in range(4):
            length = int(torch.randint(2, 6, (1,), generator=gen))
            response = torch.randint(10, 40, (length,), generator=gen).tolist()
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0, :-1], -1)
            picked = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)]
            samples.append(
                Sample(
                    sample_id=f"{i}-{j}",
                    index=j,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    rollout_logprobs=picked,
                    loss_mask=[1] * length,
                    reward=float(torch.rand(1, generator=gen)),
                    weight_versions=[0],
                    status=SampleStatus.SAMPLE_STATUS_OK,
                )
            )
        groups.append(SampleGroup(group_id=f"g{i}", run_id=run_id, samples=samples, weight=1.0))
    return groups


def appended(stream: SampleStream, group: SampleGroup) -> str:
    entry_id = stream.append(group)
    assert entry_id is not None, f"{group.group_id} was on the stream already"
    return entry_id


def settings_for(work_dir: Path, redis_prefix: str) -> TrainerSettings:
    return TrainerSettings(redis_prefix=redis_prefix, work_dir=work_dir, read_block_ms=100, torch_threads=1)


def wait_for(
    predicate: Callable[[], bool], what: str, timeout: float = 60.0, child: ServiceProcess | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if child is not None:
            assert child.alive(), f"the trainer process died while waiting for {what}:\n{child.log_tail()}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_to_the_end(core: TrainerCore, run_id: str, spec: RunSpec) -> None:
    core.start_run(run_id, spec)
    wait_for(lambda: core.status(run_id).state != TrainerState.TRAINER_STATE_TRAINING, f"run {run_id} to end")
    assert core.status(run_id).state == TrainerState.TRAINER_STATE_STOPPED, core.status(run_id).error


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as the child process runs: the same reductions in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_sigkill_between_checkpoints_resumes_and_matches_an_uninterrupted_run(
    tmp_path: Path, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router
) -> None:
    spec = spec_for(small_model_dir)
    settings = settings_for(tmp_path / "trainer", redis_prefix)
    stream = SampleStream(redis_client, "killed", prefix=redis_prefix)
    groups = make_groups(small_model_dir, "killed", STEPS * GROUPS_PER_STEP)
    entry_ids = [appended(stream, g) for g in groups[: KILLED_AFTER * GROUPS_PER_STEP]]

    child = ServiceProcess(
        "trainer",
        [sys.executable, __file__, str(small_model_dir), str(settings.work_dir), redis_prefix, fake_router.url],
        tmp_path / "trainer.log",
    )
    try:
        # The child trains 3 steps, checkpoints after step 2, and then waits for step 4's groups.
        wait_for(
            lambda: any(load["weight_version"] == str(KILLED_AFTER) for load in fake_router.loads),
            "the killed trainer's step 3",
            timeout=120,
            child=child,
        )
        child.kill()
    finally:
        child.stop()
    record = RunStateStore(redis_client, redis_prefix).load("killed")
    assert record is not None and (record.step, record.groups_trained) == (2, 4), child.log_tail()
    assert record.last_entry_id == entry_ids[3]
    pending = redis_client.xpending_range(stream.key, stream.consumer_group, min="-", max="+", count=100)
    # Step 3's groups: trained, not covered by the checkpoint.
    assert [p["message_id"] for p in pending] == [i.encode() for i in entry_ids[4:6]]

    for group in groups[KILLED_AFTER * GROUPS_PER_STEP :]:
        stream.append(group)
    resumed = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    reference = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    try:
        loads_before = len(fake_router.loads)
        run_to_the_end(resumed, "killed", spec)
        reports = resumed.reports("killed", 0)[0]
        assert [r.step for r in reports] == [3, 4, 5, 6]
        assert sum(r.groups for r in reports) == 8  # the 2 groups after the checkpoint again, then the 6 new ones
        assert [load["weight_version"] for load in fake_router.loads[loads_before:]] == ["2", "3", "4", "5", "6"]
        final = resumed.status("killed")
        assert (final.groups_trained, final.checkpoint_step) == (12, 6) and stream.pending_count() == 0

        # The same groups, never interrupted.
        reference_stream = SampleStream(redis_client, "straight", prefix=redis_prefix)
        for group in make_groups(small_model_dir, "straight", STEPS * GROUPS_PER_STEP):
            reference_stream.append(group)
        run_to_the_end(reference, "straight", spec)
    finally:
        resumed.shutdown()
        reference.shutdown()
    expected = load_policy(reference.status("straight").weights_path).state_dict()
    got = load_policy(final.weights_path).state_dict()
    base = load_policy(small_model_dir).state_dict()
    assert any(not torch.allclose(base[k], expected[k], atol=1e-3) for k in expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_claiming_stale_groups_leaves_the_trainers_own_pending_ones(
    small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str
) -> None:
    """Trained groups stay pending on the trainer until a checkpoint: however long that takes, they
    must not come back to it as "stale" and be trained twice."""
    stream = SampleStream(redis_client, "claims", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [appended(stream, g) for g in make_groups(small_model_dir, "claims", 3)]
    stream.read("trainer-0", count=2)
    stream.read("dead", count=1)
    time.sleep(0.1)
    claimed = stream.claim_stale("trainer-0", min_idle_ms=50, count=10)
    assert [e.entry_id for e in claimed] == ids[2:]
    assert [e.entry_id for e in stream.read_own_pending("trainer-0", 10, after=ids[0])] == ids[1:]


def child_main(model_dir: str, work_dir: str, redis_prefix: str, router_url: str) -> None:
    """The trainer that gets killed: trains the run until the parent SIGKILLs it (bounded)."""
    import os

    torch.set_num_threads(1)
    client = connect_redis(os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    core = TrainerCore(
        settings_for(Path(work_dir), redis_prefix), client, RouterClient(router_url, 30.0), TrainerMetrics()
    )
    core.start_run("killed", spec_for(Path(model_dir)))
    time.sleep(300)
    raise SystemExit("not killed within 300 s")


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
