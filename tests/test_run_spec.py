from __future__ import annotations

import re

import pytest
from google.protobuf import json_format

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import ALGORITHMS, GROUP_RELATIVE, MAX_EPOCHS, MAX_EVAL_SIZE, resolve, validate
from rlfleet.v1.runs_pb2 import RunSpec

MINIMAL = {
    "model": {"path": "/models/tiny"},
    "dataset": {"arithmetic": {}},
    "reward": {"terms": [{"function": "arith_exact"}]},
    "schedule": {"steps": 10},
}


def spec_from(overrides: dict) -> RunSpec:
    def merge(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
        return out

    return json_format.ParseDict(merge(MINIMAL, overrides), RunSpec())


def test_defaults_are_filled_and_the_input_is_untouched() -> None:
    spec = spec_from({})
    resolved = resolve(spec)
    validate(resolved)
    assert resolved.rollout.group_size == 8 and resolved.rollout.groups_per_step == 16
    assert resolved.rollout.sampling.temperature == 1.0 and resolved.rollout.sampling.max_new_tokens == 16
    assert resolved.algorithm.name == "grpo" and resolved.algorithm.clip_high == pytest.approx(0.2)
    assert resolved.reward.terms[0].weight == 1.0
    assert resolved.dataset.arithmetic.digits == 2 and resolved.dataset.arithmetic.ops == "+"
    assert resolved.model.tokenizer_path == "/models/tiny"
    assert not spec.rollout.HasField("group_size")
    ro = resolved.rollout
    assert (ro.oversample, ro.max_prompts_per_step, ro.truncated, ro.stale_groups, ro.stale_weight) == (
        1.0,
        64,
        "keep",
        "drop",
        0.5,
    )
    assert resolved.dataset.bad_rows == "reject" and resolved.schedule.eval_samples == 1
    assert ro.on_weight_update == "finish"


@pytest.mark.parametrize("multi_turn", [{"max_turns": 2}, {"environment": "calculator"}])
def test_single_turn_drops_the_multi_turn_settings_it_ignores(multi_turn: dict) -> None:
    """Kept, the block gave the run an environment: its evaluation ran calculator episodes (with max_turns 0), and
    a block of max_turns alone was refused at submit for an unknown environment ''."""
    resolved = resolve(spec_from({"rollout": {"multi_turn": multi_turn}}))
    validate(resolved)
    assert resolved.rollout.function == "single_turn" and not resolved.rollout.HasField("multi_turn")
    kept = resolve(spec_from({"rollout": {"function": "multi_turn", "multi_turn": multi_turn}})).rollout.multi_turn
    assert kept.environment == "calculator" and kept.max_turns == multi_turn.get("max_turns", 3)


def test_explicit_zero_is_kept_where_zero_means_something() -> None:
    resolved = resolve(spec_from({"rollout": {"sampling": {"temperature": 0}}, "algorithm": {"clip_low": 0.1}}))
    assert resolved.rollout.sampling.temperature == 0.0
    assert resolved.algorithm.clip_high == pytest.approx(0.1)
    assert resolve(spec_from({"trainer": {"checkpoint_every": 0}})).trainer.checkpoint_every == 0, "only at the end"


def test_a_run_checkpoints_every_50_steps_unless_told_otherwise() -> None:
    """A checkpoint acknowledges the groups a run trained on and is where a restarted trainer resumes: with none
    until its end (the default was 0), a trainer crash lost every step and Redis kept all of the run's groups."""
    assert resolve(spec_from({})).trainer.checkpoint_every == 50
    assert resolve(spec_from({"trainer": {"checkpoint_every": 7}})).trainer.checkpoint_every == 7


def test_each_algorithm_fills_its_own_defaults() -> None:
    def algorithm(name: str, **extra: object):
        return resolve(spec_from({"algorithm": {"name": name, **extra}})).algorithm

    grpo = algorithm("grpo")
    assert (grpo.loss_aggregation, grpo.kl_mode, grpo.tis_cap) == ("seq_mean_token_mean", "loss", 0.0)
    assert grpo.clip_ratio_c == 3.0 and algorithm("grpo", clip_ratio_c=0).clip_ratio_c == 0.0  # verl's dual clip
    dapo = algorithm("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_aggregation) == (0.2, 0.28, "token_mean")
    gspo = algorithm("gspo")
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    assert algorithm("dr_grpo").loss_aggregation == "seq_mean_token_sum_norm"
    ppo = algorithm("ppo")
    assert (ppo.kl_mode, ppo.gamma, ppo.gae_lambda, ppo.value_clip) == ("reward", 1.0, 0.95, 0.2)
    assert ppo.critic_learning_rate == pytest.approx(1e-3)  # 10 x the default learning rate
    assert algorithm("reinforce_pp_baseline").kl_mode == "reward"
    explicit = algorithm("dapo", clip_high=0.3, loss_aggregation="seq_mean_token_mean", kl_mode="reward")
    assert (explicit.clip_high, explicit.loss_aggregation, explicit.kl_mode) == (0.3, "seq_mean_token_mean", "reward")
    assert resolve(spec_from({})).trainer.lr_schedule == "constant"


def test_the_kl_estimator_follows_where_the_penalty_goes() -> None:
    """In the reward only k1's expectation has the KL's gradient; k3 there nearly cancels near the reference (a
    penalty that barely pulls), yet it was the default for ppo, rloo and reinforce_pp, whose KL is in the reward."""

    def algorithm(name: str, **extra: object):
        return resolve(spec_from({"algorithm": {"name": name, **extra}})).algorithm

    assert [(algorithm(n).kl_mode, algorithm(n).kl_estimator) for n in ("grpo", "ppo", "rloo", "reinforce_pp")] == [
        ("loss", "k3"),
        ("reward", "k1"),
        ("reward", "k1"),
        ("reward", "k1"),
    ]
    assert algorithm("grpo", kl_mode="reward").kl_estimator == "k1"
    assert algorithm("ppo", kl_mode="loss").kl_estimator == "k3"
    assert algorithm("ppo", kl_estimator="k3").kl_estimator == "k3"  # asked for: kept


def test_one_update_per_batch_unless_asked_and_as_many_mini_batches_as_samples() -> None:
    trainer = resolve(spec_from({})).trainer
    assert (trainer.mini_batches, trainer.epochs) == (1, 1)
    most = {"rollout": {"group_size": 2, "groups_per_step": 2}, "trainer": {"mini_batches": 4, "epochs": MAX_EPOCHS}}
    validate(resolve(spec_from(most)))
    validate(resolve(spec_from({"schedule": {"steps": 19997, "eval_every": 2}})))  # 10,000 evaluations


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"algorithm": {"loss_aggregation": "sum"}}, "algorithm.loss_aggregation"),
        ({"algorithm": {"kl_mode": "both"}}, "algorithm.kl_mode"),
        ({"algorithm": {"tis_cap": 0.5}}, "algorithm.tis_cap"),
        ({"algorithm": {"ratio_mask_high": 0.9}}, "algorithm.ratio_mask_high"),
        ({"algorithm": {"ratio_mask_low": 1.5}}, "algorithm.ratio_mask_low"),
        ({"algorithm": {"name": "ppo", "gamma": 0}}, "algorithm.gamma"),
        ({"algorithm": {"name": "ppo", "gae_lambda": 1.5}}, "algorithm.gae_lambda"),
        ({"algorithm": {"name": "ppo", "value_clip": 0}}, "algorithm.value_clip"),
        # Read only by ppo: a grpo run with a discount of 0.9 trained undiscounted, saying nothing.
        ({"algorithm": {"name": "grpo", "gamma": 0.9}}, "algorithm.gamma"),
        ({"algorithm": {"name": "reinforce_pp", "gae_lambda": 0.9}}, "algorithm.gae_lambda"),
        ({"algorithm": {"name": "gspo", "value_clip": 0.5}}, "algorithm.value_clip"),
        ({"algorithm": {"clip_ratio_c": 0.9}}, "algorithm.clip_ratio_c"),
        # Infinite in the trainer's float32: the loss was NaN (0 x inf) or infinite at every step.
        ({"algorithm": {"kl_coef": 1e39}}, "algorithm.kl_coef"),
        ({"algorithm": {"entropy_coef": -1e39}}, "algorithm.entropy_coef"),
        # AdamW scaled every weight by 1 - 1e-4 x 3e4 = -2 a step: infinite within a hundred steps.
        ({"trainer": {"learning_rate": 1e-4, "weight_decay": 3e4}}, "trainer.weight_decay"),
        ({"trainer": {"learning_rate": 0.5, "weight_decay": 2}}, "trainer.weight_decay"),
        ({"trainer": {"weight_decay": -0.1}}, "trainer.weight_decay"),
        ({"trainer": {"lr_schedule": "step"}}, "trainer.lr_schedule"),
        ({"trainer": {"min_lr_ratio": 2}}, "trainer.min_lr_ratio"),
        ({"trainer": {"pack_row_tokens": -1}}, "trainer.pack_row_tokens"),
        ({"trainer": {"mini_batches": 0}}, "trainer.mini_batches"),
        # 2 groups of 2 samples: a fifth mini-batch would hold nothing.
        ({"rollout": {"group_size": 2, "groups_per_step": 2}, "trainer": {"mini_batches": 5}}, "trainer.mini_batches"),
        ({"trainer": {"epochs": 0}}, "trainer.epochs"),
        ({"trainer": {"epochs": MAX_EPOCHS + 1}}, "trainer.epochs"),
        ({"model": {"path": ""}}, "model.path"),
        ({"rollout": {"group_size": 1}}, "rollout.group_size"),
        ({"rollout": {"sampling": {"top_p": 0}}}, "rollout.sampling.top_p"),
        ({"rollout": {"sampling": {"max_new_tokens": 0}}}, "rollout.sampling.max_new_tokens"),
        ({"dataset": {"arithmetic": {"ops": "^"}}}, "dataset.arithmetic.ops"),
        ({"algorithm": {"name": "magic"}}, "algorithm.name"),
        ({"algorithm": {"kl_estimator": "k9"}}, "algorithm.kl_estimator"),
        ({"trainer": {"learning_rate": 5}}, "trainer.learning_rate"),
        ({"schedule": {"steps": 0}}, "schedule.steps"),
        ({"reward": {"terms": []}}, "reward.terms"),
        ({"reward": {"terms": [{"function": "arith_exact", "weight": "NaN"}]}}, "reward.terms[0].weight"),
        ({"reward": {"terms": [{"function": "arith_exact", "weight": 1e12}]}}, "reward.terms[0].weight"),
        ({"dataset": {"bad_rows": "ignore"}}, "dataset.bad_rows"),
        ({"rollout": {"oversample": 0.5}}, "rollout.oversample"),
        ({"rollout": {"groups_per_step": 4, "max_prompts_per_step": 3}}, "rollout.max_prompts_per_step"),
        ({"rollout": {"max_prompt_tokens": -1}}, "rollout.max_prompt_tokens"),
        ({"rollout": {"truncated": "drop"}}, "rollout.truncated"),
        ({"rollout": {"stale_groups": "keep"}}, "rollout.stale_groups"),
        ({"rollout": {"stale_weight": 0}}, "rollout.stale_weight"),
        ({"rollout": {"on_weight_update": "drop"}}, "rollout.on_weight_update"),
        ({"schedule": {"eval_samples": 0}}, "schedule.eval_samples"),
        # 10,002 evaluations: the run's record outgrew what a gRPC client receives by default.
        ({"schedule": {"steps": 20001, "eval_every": 2}}, "schedule.eval_every"),
        ({"dataset": {"eval_size": 0}}, "dataset.eval_size"),
        ({"dataset": {"eval_size": MAX_EVAL_SIZE + 1}}, "dataset.eval_size"),
        (
            {"reward": {"terms": [{"function": "math"}, {"function": "f1"}, {"function": "math"}]}},
            "reward.terms[2].function",
        ),
        (
            {"reward": {"terms": [{"function": "numeric", "params": {"abs_tol": float("nan")}}]}},
            "reward.terms[0].params.abs_tol",
        ),
        ({"reward": {"timeout_seconds": -1}}, "reward.timeout_seconds"),
        ({"reward": {"timeout_seconds": 0}}, "reward.timeout_seconds"),
        ({"reward": {"timeout_seconds": "NaN"}}, "reward.timeout_seconds"),
        ({"reward": {"timeout_seconds": "Infinity"}}, "reward.timeout_seconds"),
        # Every generation refused it, hours into the run.
        ({"rollout": {"sampling": {"stop": ["</answer>", ""]}}}, "rollout.sampling.stop[1]"),
        # No reward to earn: full marks were any score (of a negative bar), and every evaluation 100%.
        ({"reward": {"terms": [{"function": "arith_exact", "weight": 0}]}}, "reward.terms"),
        (
            {"reward": {"terms": [{"function": "arith_exact", "weight": 0}, {"function": "length", "weight": -1}]}},
            "reward.terms",
        ),
        # Greedy: a group of identical samples, whose group-relative advantages are all 0.
        ({"rollout": {"sampling": {"temperature": 0}}}, "rollout.sampling.temperature"),
        ({"rollout": {"sampling": {"temperature": 1e-9}}}, "rollout.sampling.temperature"),
        ({"algorithm": {"name": "rloo"}, "rollout": {"sampling": {"top_k": 1}}}, "rollout.sampling.top_k"),
        # k greedy answers to a held-out prompt are one answer k times.
        (
            {
                "algorithm": {"name": "ppo"},
                "rollout": {"sampling": {"temperature": 0}},
                "schedule": {"eval_samples": 4},
            },
            "schedule.eval_samples",
        ),
    ],
)
def test_bad_fields_are_named(overrides: dict, field: str) -> None:
    with pytest.raises(InvalidInput, match="^" + re.escape(field) + ":"):
        validate(resolve(spec_from(overrides)))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_greedy_sampling_is_refused_exactly_for_group_relative_advantages(name: str) -> None:
    greedy = spec_from({"algorithm": {"name": name}, "rollout": {"sampling": {"temperature": 0}}})
    if name in GROUP_RELATIVE:
        with pytest.raises(InvalidInput, match=rf"^rollout\.sampling\.temperature: .* {name}'s group-relative"):
            validate(resolve(greedy))
    else:  # a critic (ppo) or the whole batch (reinforce_pp) gives identical samples an advantage
        validate(resolve(greedy))
    penalised = {"terms": [{"function": "arith_exact", "weight": 0.5}, {"function": "length", "weight": -1}]}
    validate(resolve(spec_from({"algorithm": {"name": name}, "reward": penalised})))


def test_group_relative_names_the_algorithms_whose_advantages_a_group_of_equal_rewards_zeroes() -> None:
    """GROUP_RELATIVE is the trainer's to say: each of its algorithms gives groups of equal rewards no advantage,
    and every other still learns from them."""
    torch = pytest.importorskip("torch")
    algorithms = pytest.importorskip("rlfleet_trainer.algorithms")
    ones = torch.ones(4, 3)
    inputs = algorithms.AdvantageInputs(
        rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]),
        groups=torch.tensor([0, 0, 1, 1]),
        mask=ones,
        present=ones,
        kl=torch.zeros(4, 3),
        kl_coef=0.0,
        values=torch.tensor([[0.1, 0.5, 0.2], [0.3, 0.1, 0.4], [0.2, 0.2, 0.6], [0.5, 0.3, 0.1]]),
    )
    zeroed = {
        name for name, algorithm in algorithms.ALGORITHMS.items() if not algorithm.advantages(inputs).advantages.any()
    }
    assert zeroed == GROUP_RELATIVE


def test_a_function_listed_twice_names_the_first_listing() -> None:
    twice = {"reward": {"terms": [{"function": "math"}, {"function": "math", "weight": 2}]}}
    with pytest.raises(InvalidInput, match=re.escape("reward.terms[1].function: 'math' is already reward.terms[0]")):
        validate(resolve(spec_from(twice)))


def test_a_non_finite_number_anywhere_in_params_is_named() -> None:
    spec = spec_from({})
    params = spec.reward.terms[0].params
    params.update({"ok": 1.5, "nested": {"list": [1, "x", {"deep": 2}]}})
    validate(resolve(spec))
    params["nested"]["list"][2]["deep"] = float("-inf")
    with pytest.raises(InvalidInput, match=re.escape("reward.terms[0].params.nested.list[2].deep: must be a finite")):
        validate(resolve(spec))


def test_the_largest_eval_size_and_any_positive_reward_time_limit_pass() -> None:
    # The time limit's upper bound is a reward hub setting (max_timeout_seconds): the hub checks it at submit.
    validate(resolve(spec_from({"dataset": {"eval_size": MAX_EVAL_SIZE}, "reward": {"timeout_seconds": 1e9}})))


def test_the_largest_loss_coefficients_and_weight_decay_pass() -> None:
    largest = {
        "algorithm": {"kl_coef": 1e9, "entropy_coef": -1e9},
        "trainer": {"learning_rate": 0.5, "weight_decay": 1.9},
    }
    validate(resolve(spec_from(largest)))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("learning_rate", [0, -1e-4, 5, "NaN"])
def test_a_bad_learning_rate_is_named_not_the_critic_rate_derived_from_it(
    algorithm: str, learning_rate: object
) -> None:
    # The critic's rate defaults to 10 x trainer.learning_rate: the error names the field the user set.
    spec = spec_from({"algorithm": {"name": algorithm}, "trainer": {"learning_rate": learning_rate}})
    with pytest.raises(InvalidInput, match="^trainer.learning_rate:"):
        validate(resolve(spec))
    spec.algorithm.critic_learning_rate = 2.0  # set by the user, and wrong: named once the learning rate is right
    spec.trainer.learning_rate = 1e-4
    with pytest.raises(InvalidInput, match="^algorithm.critic_learning_rate:"):
        validate(resolve(spec))


def test_missing_dataset_is_named() -> None:
    spec = spec_from({})
    spec.ClearField("dataset")
    with pytest.raises(InvalidInput, match="^dataset:"):
        validate(resolve(spec))
