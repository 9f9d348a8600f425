"""Every registered algorithm takes a real step on a small model; the registry and the RunSpec
validation agree; micro-batching does not change the step."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from google.protobuf import json_format

from rlfleet import run_spec
from rlfleet.v1.runs_pb2 import RunSpec, SamplingParams
from rlfleet.v1.samples_pb2 import SampleGroup, SampleStatus
from rlfleet_trainer.algorithms import ALGORITHMS
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.optim import optimizer_from_spec
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.train_step import StepConfig, scoring_temperature, step_config_from_spec, train_step

sys.path.insert(0, str(Path(__file__).parent))
from sample_groups import scored_groups  # noqa: E402


def test_registry_and_run_spec_name_the_same_algorithms() -> None:
    assert set(ALGORITHMS) == set(run_spec.ALGORITHMS) == set(run_spec.ALGORITHM_DEFAULTS)


LEARNING_RATE = 1e-3


def spec(algorithm: dict, micro_batch_tokens: int = 8192) -> RunSpec:
    raw = {
        "model": {"path": "/unused"},
        "dataset": {"arithmetic": {}},
        "rollout": {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "algorithm": algorithm,
        "trainer": {"learning_rate": LEARNING_RATE, "micro_batch_tokens": micro_batch_tokens},
        "schedule": {"steps": 2},
    }
    resolved = run_spec.resolve(json_format.ParseDict(raw, RunSpec()))
    run_spec.validate(resolved)
    return resolved


def groups_from(model: torch.nn.Module, count: int = 2) -> list[SampleGroup]:
    """Rollout log-probs `model`'s own plus a little noise, as an engine's numerics would give."""
    return scored_groups(model, count, noise=0.01)


def drifted_reference(model_dir: Path) -> torch.nn.Module:
    """A reference the policy has moved away from: the checkpoint after a random step."""
    ref = load_policy(model_dir).requires_grad_(False)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in ref.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return ref


def step(
    model_dir: Path, resolved: RunSpec, with_ref: bool, groups: int = 2, same_ref: bool = False
) -> tuple[torch.nn.Module, dict[str, float], StepConfig]:
    torch.manual_seed(0)
    model = load_policy(model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    ref = None
    if with_ref:
        ref = load_policy(model_dir).requires_grad_(False) if same_ref else drifted_reference(model_dir)
    metrics = train_step(model, optimizer, scheduler, groups_from(load_policy(model_dir), groups), config, ref)
    return model, metrics, config


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithm_takes_a_step(small_model_dir: Path, name: str) -> None:
    extra = {"tis_cap": 2.0, "ratio_mask_low": 0.5, "ratio_mask_high": 2.0} if name == "grpo" else {}
    resolved = spec({"name": name, "kl_coef": 0.05, "entropy_coef": 0.001, **extra})
    before = load_policy(small_model_dir).state_dict()
    model, metrics, config = step(small_model_dir, resolved, with_ref=True)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["grad_norm"] > 0 and metrics["samples"] == 8
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    if name == "ppo":
        assert metrics["value_loss"] > 0
        assert config.critic is not None and config.critic.head.bias.item() != 0.0
    if name == "grpo":
        assert metrics["tis_weight"] > 0 and "ratio_masked_frac" in metrics


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_accumulate_to_one_pass(small_model_dir: Path, name: str) -> None:
    whole, m1, _ = step(small_model_dir, spec({"name": name}, micro_batch_tokens=4096), with_ref=False, groups=6)
    split, m2, _ = step(small_model_dir, spec({"name": name}, micro_batch_tokens=64), with_ref=False, groups=6)
    assert m1["micro_batches"] == 1 and m2["micro_batches"] > 1
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)  # the accumulated gradient, unscaled
    # Adam's first step moves a weight by about the learning rate times the sign of its gradient, and by
    # less only where the gradient is near eps (1e-8), where summation order moves it: a few % of lr.
    for (key, a), b in zip(whole.state_dict().items(), split.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=LEARNING_RATE / 20), key


@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
def test_responses_without_a_trained_token_do_not_count_among_the_sequences(small_model_dir: Path, name: str) -> None:
    """A group whose responses were all masked (truncated under rollout.truncated "mask") leaves the step as
    if it were not there: counted among the sequences, it halved the other group's loss and gradient, and then
    every per-token statistic."""
    resolved = spec({"name": name, "tis_cap": 2.0, "kl_coef": 0.05, "entropy_coef": 0.001})
    policy = load_policy(small_model_dir)
    kept, masked = groups_from(policy, 2)
    for sample in masked.samples:
        sample.loss_mask[:] = [0] * len(sample.loss_mask)
    runs = []
    for groups in ([kept], [kept, masked]):
        torch.manual_seed(0)
        model = load_policy(small_model_dir)
        optimizer, scheduler = optimizer_from_spec(model, resolved)
        config = step_config_from_spec(resolved, model, pad_id=0)
        ref = load_policy(small_model_dir).requires_grad_(False)
        runs.append(train_step(model, optimizer, scheduler, groups, config, ref))
    alone, with_masked = runs
    assert with_masked["samples"] == 8
    assert with_masked["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    assert with_masked["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    for stat in ("tis_weight", "kl", "entropy", "approx_kl", "pg_clipfrac"):
        assert with_masked[stat] == pytest.approx(alone[stat], rel=1e-5, abs=1e-9), stat


def test_failed_samples_do_not_count_in_the_mean_reward(small_model_dir: Path) -> None:
    """A failed sample carries reward 0 for want of a score: counted, an engine fault read as a worse policy."""
    resolved = spec({"name": "grpo"})
    groups = groups_from(load_policy(small_model_dir), 2)
    for sample in groups[0].samples:
        sample.reward = 1.0
    groups[1].samples[0].status = SampleStatus.SAMPLE_STATUS_FAILED
    groups[1].samples[1].status = SampleStatus.SAMPLE_STATUS_ABORTED
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    metrics = train_step(model, optimizer, scheduler, groups, step_config_from_spec(resolved, model, pad_id=0))
    scored = [s.reward for s in groups[0].samples] + [s.reward for s in groups[1].samples[2:]]
    assert metrics["samples"] == 6 and metrics["reward_mean"] == pytest.approx(sum(scored) / 6)

    # A step none of whose samples was scored has no mean reward: it was 0, which read as a collapse.
    for group in groups:
        for sample in group.samples:
            sample.status = SampleStatus.SAMPLE_STATUS_FAILED
    metrics = train_step(model, optimizer, scheduler, groups, step_config_from_spec(resolved, model, pad_id=0))
    assert "reward_mean" not in metrics


def test_kl_in_the_reward_changes_the_advantages_not_the_loss_terms(small_model_dir: Path) -> None:
    in_loss = spec({"name": "rloo", "kl_coef": 0.5, "kl_mode": "loss"})
    in_reward = spec({"name": "rloo", "kl_coef": 0.5})
    assert in_reward.algorithm.kl_mode == "reward"
    _, loss_metrics, _ = step(small_model_dir, in_loss, with_ref=True)
    _, reward_metrics, _ = step(small_model_dir, in_reward, with_ref=True)
    assert "kl" in loss_metrics and "kl" not in reward_metrics
    assert reward_metrics["advantage_abs_mean"] != pytest.approx(loss_metrics["advantage_abs_mean"])


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "ppo"])
def test_a_policy_equal_to_its_reference_has_no_kl_in_the_reward_whatever_the_engines_numerics(
    small_model_dir: Path, name: str
) -> None:
    """The rollout log-probs carry the engines' numerics (noise of 0.01 here): taken as the policy's in the
    reward's KL, that noise read as a KL to a reference the policy still equals, and became advantage signal."""
    with_kl = step(small_model_dir, spec({"name": name, "kl_coef": 0.5}), with_ref=True, same_ref=True)[1]
    without = step(small_model_dir, spec({"name": name}), with_ref=False)[1]
    assert with_kl["advantage_abs_mean"] == pytest.approx(without["advantage_abs_mean"], rel=1e-5, abs=1e-7)


def test_the_critic_is_kept_across_steps(small_model_dir: Path) -> None:
    resolved = spec({"name": "ppo"})
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    groups = groups_from(copy.deepcopy(model))
    first = train_step(model, optimizer, scheduler, groups, config)
    second = train_step(model, optimizer, scheduler, groups, config)
    assert second["value_loss"] < first["value_loss"]  # the head learned the returns of the same batch


def with_tool_output(model_dir: Path, placeholder_logprob: float) -> list[SampleGroup]:
    """Multi-turn-like groups: two tokens of a tool's reply inside each response, with loss mask 0 and
    the rollout log-prob the router writes for tokens no engine sampled (a placeholder)."""
    groups = groups_from(load_policy(model_dir))
    for group in groups:
        for sample in group.samples:
            sample.response_token_ids[1:1] = [30, 31]
            sample.rollout_logprobs[1:1] = [placeholder_logprob] * 2
            sample.loss_mask[1:1] = [0, 0]
    return groups


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "ppo"])
def test_the_kl_in_the_reward_counts_only_the_tokens_the_policy_sampled(small_model_dir: Path, name: str) -> None:
    """A tool's output was not sampled from the policy, and its rollout log-prob says nothing about it:
    whatever that placeholder is, it must not become a KL penalty on the response."""
    resolved = spec({"name": name, "kl_coef": 0.5})
    assert resolved.algorithm.kl_mode == "reward"
    advantages = []
    for placeholder in (0.0, -7.0):
        torch.manual_seed(0)
        model = load_policy(small_model_dir)
        optimizer, scheduler = optimizer_from_spec(model, resolved)
        config = step_config_from_spec(resolved, model, pad_id=0)
        ref = load_policy(small_model_dir).requires_grad_(False)
        groups = with_tool_output(small_model_dir, placeholder)
        advantages.append(train_step(model, optimizer, scheduler, groups, config, ref)["advantage_abs_mean"])
    assert advantages[0] == pytest.approx(advantages[1], rel=1e-6)


def test_a_step_whose_gradient_is_not_finite_leaves_the_weights_and_the_optimizer_as_they_were(
    small_model_dir: Path,
) -> None:
    """An overflow in the model's numerics (one NaN gradient) would make every weight and Adam's moments NaN
    for good, and the NaN weights would reach the fleet: the update is skipped, the next one is taken."""
    resolved = spec({"name": "grpo"})
    model = load_policy(small_model_dir)
    optimizer, scheduler = optimizer_from_spec(model, resolved)
    config = step_config_from_spec(resolved, model, pad_id=0)
    groups = groups_from(copy.deepcopy(model))
    before = copy.deepcopy(model.state_dict())
    first = next(p for p in model.parameters() if p.requires_grad)
    poison = first.register_hook(lambda grad: grad * float("nan"))
    skipped = train_step(model, optimizer, scheduler, groups, config)
    poison.remove()
    assert skipped["update_skipped"] == 1.0 and not torch.isfinite(torch.tensor(skipped["grad_norm"]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state  # no moment was taken from the NaN gradient
    assert scheduler.last_epoch == 0  # nor a step of the learning-rate schedule
    taken = train_step(model, optimizer, scheduler, groups, config)
    assert taken["update_skipped"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_a_skipped_update_is_counted() -> None:
    metrics = TrainerMetrics()
    metrics.observe_step({"update_skipped": 0.0})
    metrics.observe_step({"update_skipped": 1.0})
    assert metrics.registry.get_sample_value("rlfleet_trainer_skipped_updates_total") == 1.0


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"temperature": 0.7}, 0.7),
        ({"temperature": 0.7, "top_k": 5}, 0.7),
        ({"temperature": 0.7, "top_k": 1}, 0.0),  # greedy: the engine's log-probs are unscaled
        ({"temperature": 5e-7}, 0.0),
        ({"temperature": 0.0}, 0.0),
        ({}, 1.0),
    ],
)
def test_log_probs_are_taken_at_the_temperature_the_engine_sampled_at(
    sampling: dict[str, float], expected: float
) -> None:
    """An engine samples greedily at a temperature under 1e-6 or top_k 1 and reports a token's log-prob from the
    logits unscaled (SGLang's rule); the trainer divided them by the spec's temperature all the same, so the first
    update of on-policy data saw ratios of 1.03."""
    assert scoring_temperature(json_format.ParseDict(sampling, SamplingParams())) == expected
