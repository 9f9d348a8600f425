"""Several optimizer updates per rollout batch (trainer.mini_batches, trainer.epochs): the split of the
batch, the updates and the learning-rate schedule they advance, and PPO's clip, which a second update
finally gives something to bound."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from google.protobuf import json_format

from rlfleet import run_spec
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import SampleGroup, SampleStatus
from rlfleet_trainer.checkpoint import CheckpointMeta, TrainingState, load_checkpoint, save_checkpoint
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.mini_batches import mini_batch_parts
from rlfleet_trainer.optim import optimizer_from_spec
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.train_step import step_config_from_spec, train_step

sys.path.insert(0, str(Path(__file__).parent))
from sample_groups import scored_groups  # noqa: E402

GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4]  # the group of each sequence; group 2 lost a sample


def test_parts_cover_every_sequence_once_and_keep_groups_together() -> None:
    parts = mini_batch_parts(GROUPS, 2, seed=0, step=1, epoch=0)
    assert len(parts) == 2 and sorted(i for part in parts for i in part) == list(range(len(GROUPS)))
    assert all(part == sorted(part) for part in parts)
    assert sorted(g for part in parts for g in {GROUPS[i] for i in part}) == sorted(set(GROUPS))  # groups kept whole
    assert [len({GROUPS[i] for i in part}) for part in parts] in ([3, 2], [2, 3])  # nearly equal numbers of groups
    assert mini_batch_parts(GROUPS, 2, seed=0, step=1, epoch=0) == parts  # the same on every rank, and on resume
    orders = {tuple(map(tuple, mini_batch_parts(GROUPS, 2, seed=0, step=1, epoch=e))) for e in range(8)}
    assert len(orders) > 1  # each epoch its own order


def test_one_part_is_the_batch_in_order_and_more_parts_than_groups_split_groups() -> None:
    assert mini_batch_parts(GROUPS, 1, seed=5, step=9, epoch=3) == [list(range(len(GROUPS)))]
    parts = mini_batch_parts(GROUPS, 7, seed=0, step=1, epoch=0)  # 5 groups: dealt sequence by sequence
    assert len(parts) == 7 and sorted(i for part in parts for i in part) == list(range(len(GROUPS)))
    assert {len(part) for part in parts} == {1, 2}
    assert len(mini_batch_parts([0, 0, 1], 8, seed=0, step=1, epoch=0)) == 3  # at most one part per sequence
    assert mini_batch_parts([], 4, seed=0, step=1, epoch=0) == []


def spec(algorithm: dict, trainer: dict, steps: int = 2) -> RunSpec:
    raw = {
        "model": {"path": "/unused"},
        "dataset": {"arithmetic": {}},
        "rollout": {"group_size": 4, "groups_per_step": 4, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "algorithm": algorithm,
        "trainer": {"learning_rate": 1e-3, "micro_batch_tokens": 64, **trainer},
        "schedule": {"steps": steps},
    }
    resolved = run_spec.resolve(json_format.ParseDict(raw, RunSpec()))
    run_spec.validate(resolved)
    return resolved


def batch(model: torch.nn.Module, count: int = 4) -> list[SampleGroup]:
    """Rollout log-probs the model's own (as a same-weights engine's)."""
    return scored_groups(model, count)


def adam_steps(optimizer: torch.optim.Optimizer) -> set[int]:
    return {int(state["step"]) for state in optimizer.state.values()}


@pytest.mark.parametrize(("mini_batches", "epochs"), [(2, 1), (2, 2), (1, 3)])
def test_a_step_takes_mini_batches_x_epochs_updates(small_model_dir: Path, mini_batches: int, epochs: int) -> None:
    resolved = spec({"name": "ppo"}, {"mini_batches": mini_batches, "epochs": epochs})
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    metrics = train_step(model, optimizer, scheduler, batch(copy.deepcopy(model)), config, step=1)
    updates = mini_batches * epochs
    assert metrics["optimizer_updates"] == updates and metrics["update_skipped"] == 0
    assert adam_steps(optimizer) == {updates} and scheduler.last_epoch == updates
    assert config.critic is not None and adam_steps(config.critic.optimizer) == {updates}
    assert metrics["samples"] == 16 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics


def test_an_update_whose_gradient_is_not_finite_skips_only_itself(small_model_dir: Path) -> None:
    resolved = spec({"name": "grpo"}, {"mini_batches": 2})
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    groups = batch(copy.deepcopy(model))
    before = copy.deepcopy(model.state_dict())
    first = next(p for p in model.parameters() if p.requires_grad)
    poisoned = []

    def poison_once(grad: torch.Tensor) -> torch.Tensor:
        poisoned.append(True)
        return grad * float("nan") if len(poisoned) == 1 else grad

    first.register_hook(poison_once)
    metrics = train_step(model, optimizer, scheduler, groups, config, step=1)
    assert (metrics["optimizer_updates"], metrics["update_skipped"]) == (2.0, 1.0)
    assert scheduler.last_epoch == 1 and adam_steps(optimizer) == {1}  # the second update was taken
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0  # the norm of the update taken
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def clip_metrics(model_dir: Path, epochs: int) -> dict[str, float]:
    """One step of GRPO with TIS at a learning rate that moves the policy far in one update."""
    resolved = spec({"name": "grpo", "tis_cap": 2.0}, {"learning_rate": 0.05, "grad_clip": 0, "epochs": epochs})
    torch.manual_seed(0)
    model = load_policy(model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    return train_step(model, optimizer, scheduler, batch(copy.deepcopy(model)), config, step=1)


def test_with_tis_the_second_update_is_clipped_against_the_policy_before_the_first(small_model_dir: Path) -> None:
    """With TIS the PPO ratio is taken against the trainer's own log-probs before the step: 1 in the
    only update of a one-update step (the clip bounds nothing), far from 1 in a second update after a
    large first one. Were the "old" log-probs those of the current update, the second would clip nothing."""
    one = clip_metrics(small_model_dir, epochs=1)
    two = clip_metrics(small_model_dir, epochs=2)
    assert one["optimizer_updates"] == 1 and two["optimizer_updates"] == 2
    assert one["pg_clipfrac"] == 0.0
    assert two["pg_clipfrac"] > 0.0
    # The first pass is the same in both: the rollout log-probs are the model's own, so it starts on-policy.
    assert one["logprob_diff"] == pytest.approx(two["logprob_diff"]) and one["logprob_diff"] < 1e-4


def test_the_schedule_counts_updates_and_a_resumed_run_continues_on_the_same_rate(tmp_path: Path) -> None:
    """steps 3 x 2 mini-batches x 2 epochs = 12 updates, warmup 1 step = 4 updates; a checkpoint after
    the first step restores the position: the next updates' learning rates are those of an unbroken run."""
    resolved = spec({"name": "grpo"}, {"mini_batches": 2, "epochs": 2, "warmup_steps": 1, "lr_schedule": "cosine"}, 3)

    def fresh() -> TrainingState:
        model = torch.nn.Linear(2, 2)
        optimizer, scheduler = optimizer_from_spec(model, resolved)
        return TrainingState(model, optimizer, scheduler)

    def update(parts: TrainingState) -> float:
        parts.model(torch.ones(1, 2)).sum().backward()
        parts.optimizer.step()
        parts.scheduler.step()
        return float(parts.scheduler.get_last_lr()[0])

    straight = fresh()
    rates = [update(straight) for _ in range(12)]
    assert rates[:3] == pytest.approx([1e-3 * k / 4 for k in (2, 3, 4)])  # warmup over 4 updates
    assert rates[3] == pytest.approx(1e-3) and rates[-1] == pytest.approx(0.0, abs=1e-12)  # cosine to 0 at 12

    interrupted = fresh()
    for _ in range(4):
        update(interrupted)
    path = save_checkpoint(tmp_path, interrupted, CheckpointMeta(step=1))
    resumed = fresh()
    load_checkpoint(path, resumed)
    assert resumed.scheduler.get_last_lr() == pytest.approx([rates[3]])
    assert [update(resumed) for _ in range(8)] == pytest.approx(rates[4:])


def test_every_skipped_update_of_a_step_is_counted() -> None:
    metrics = TrainerMetrics()
    metrics.observe_step({"update_skipped": 2.0, "optimizer_updates": 4.0})
    assert metrics.registry.get_sample_value("rlfleet_trainer_skipped_updates_total") == 2.0


def test_a_step_with_fewer_samples_than_mini_batches_keeps_the_schedule_on_its_steps(small_model_dir: Path) -> None:
    """Failed samples leave a step fewer sequences than mini_batches: it takes one update per sequence, and
    the schedule (which counts mini_batches updates a step) moves on by the rest, to end at the last step."""
    resolved = spec({"name": "grpo"}, {"mini_batches": 16, "lr_schedule": "linear"}, steps=2)
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    for step in (1, 2):
        groups = batch(copy.deepcopy(model), count=2)  # 8 sequences
        metrics = train_step(model, optimizer, scheduler, groups, config, step=step)
        assert metrics["optimizer_updates"] == 8
        assert scheduler.last_epoch == 16 * step
    assert scheduler.get_last_lr()[0] == pytest.approx(0.0)


def test_a_step_with_no_sample_to_train_keeps_the_schedule_on_its_steps_and_reports_no_loss(
    small_model_dir: Path,
) -> None:
    """A step whose groups hold only failed samples (forwarded unless the run filters them) takes no update; it
    returned before the schedule moved on, which then ended a step late, and its gauges kept the step before's loss.
    """
    resolved = spec({"name": "grpo"}, {"mini_batches": 2, "lr_schedule": "linear"}, steps=3)
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    gauges = TrainerMetrics()
    for step in (1, 2, 3):
        groups = batch(copy.deepcopy(model), count=1)
        if step == 2:
            for sample in groups[0].samples:
                sample.status = SampleStatus.SAMPLE_STATUS_FAILED
        metrics = train_step(model, optimizer, scheduler, groups, config, step=step)
        gauges.observe_step(metrics)
        assert scheduler.last_epoch == 2 * step
        if step == 2:
            assert metrics["optimizer_updates"] == 0 and metrics["skipped"] == 1 and "loss" not in metrics
            # No loss for this step, rather than step 1's passed off as its.
            assert math.isnan(gauges.registry.get_sample_value("rlfleet_trainer_loss"))
            assert gauges.registry.get_sample_value("rlfleet_trainer_optimizer_updates") == 0
        else:
            assert metrics["optimizer_updates"] == 2
            assert gauges.registry.get_sample_value("rlfleet_trainer_loss") == metrics["loss"]
    assert adam_steps(optimizer) == {4}
    assert scheduler.get_last_lr()[0] == pytest.approx(0.0)  # the run's last step ends the schedule
