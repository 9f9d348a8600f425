"""Advantage estimators and the value loss against hand-computed values."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlfleet_trainer.advantages import (
    OutcomeEstimator,
    discounted_returns,
    gae,
    group_centered,
    group_normalized,
    leave_one_out,
    outcome_token_rewards,
    per_group,
    reinforce_pp,
)
from rlfleet_trainer.critic import clipped_value_loss

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])


def test_grpo_divides_by_the_group_std() -> None:
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert group_normalized(REWARDS, eps=0.0).tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert group_normalized(torch.tensor([2.0, 2.0, 2.0])).tolist() == [0.0, 0.0, 0.0]


def test_dr_grpo_only_centers() -> None:
    assert group_centered(REWARDS).tolist() == [0.5, -0.5, -0.5, 0.5]


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert leave_one_out(REWARDS).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert leave_one_out(torch.tensor([3.0])).tolist() == [0.0]


@pytest.mark.parametrize("estimator", [group_normalized, group_centered, leave_one_out])
@pytest.mark.parametrize("reward", [12.7, 2.9, 0.7, 3.7])
@pytest.mark.parametrize("n", [8, 16])
def test_an_all_equal_group_gets_exactly_zero(estimator: OutcomeEstimator, reward: float, n: int) -> None:
    """In float32 the mean of n equal rewards can be an ulp off; GRPO divided that by a std of the same size, and
    16 x 12.7 got advantages of +0.48 each: a group with no signal pushed all of its responses one way."""
    assert estimator(torch.full((n,), reward)).tolist() == [0.0] * n


def test_close_rewards_keep_their_order_and_scale() -> None:
    """Rewards apart by less than float32's error in their mean (12.7 against its next float) are still told apart."""
    rewards = torch.tensor([12.7, 12.7, 12.7, torch.nextafter(torch.tensor(12.7), torch.tensor(13.0)).item()])
    advantages = group_normalized(rewards, eps=0.0)
    assert advantages.tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5], rel=1e-5)


def test_estimators_apply_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    assert per_group(rewards, groups, group_centered).tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]


def test_outcome_reward_sits_on_the_last_response_token() -> None:
    present = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert outcome_token_rewards(torch.tensor([2.0, -1.0]), present).tolist() == [[0, 0, 2], [-1, 0, 0]]
    assert discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), gamma=0.5).tolist() == [[1.5, 1.0, 2.0]]


def test_reinforce_pp_by_hand() -> None:
    scores = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2], [0.3, 0.0]])
    present = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = reinforce_pp(scores, kl, kl_coef=0.5, mask=present, present=present)
    # token rewards: [-0.05, 1 - 0.1], [0 - 0.15]; returns: [0.85, 0.9], [-0.15]; whitened over 3 tokens
    returns = [0.85, 0.9, -0.15]
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    expected = [(g - mean) / std for g in returns]
    assert [adv[0, 0].item(), adv[0, 1].item(), adv[1, 0].item()] == pytest.approx(expected, rel=1e-5)
    assert adv[1, 1].item() == 0.0


@pytest.mark.parametrize("score", [0.1, 0.04, 0.7, 12.7])
def test_reinforce_pp_gives_a_batch_of_equal_returns_exactly_zero(score: float) -> None:
    """Whitened in float32, the mean of equal returns was an ulp off and its division by a std of the same size made
    advantages of up to 0.43: a step scoring 0.1 everywhere pushed every sampled token one way."""
    present = torch.ones(128, 8)
    adv = reinforce_pp(torch.full((128,), score), torch.zeros(128, 8), kl_coef=0.0, mask=present, present=present)
    assert adv.abs().max().item() == 0.0


def test_gae_by_hand() -> None:
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.8]])
    adv, returns = gae(rewards, values, torch.ones(1, 2), gamma=1.0, lam=0.5)
    # delta_1 = 1 + 0 - 0.8 = 0.2 = A_1; delta_0 = 0 + 0.8 - 0.5 = 0.3; A_0 = 0.3 + 0.5 * 0.2 = 0.4
    assert adv[0].tolist() == pytest.approx([0.4, 0.2])
    assert returns[0].tolist() == pytest.approx([0.9, 1.0])
    # gamma discounts the next value; lambda = 1 gives discounted returns minus values.
    adv, _ = gae(rewards, values, torch.ones(1, 2), gamma=0.9, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.9 * 1.0 - 0.5, 1.0 - 0.8])


def test_gae_gives_the_reward_of_tokens_off_the_mask_to_the_trained_token_before_them() -> None:
    """A response ending on an environment's reply (loss mask 0) has its outcome reward on that reply's last
    token: GAE threw it away with the reply's deltas, so PPO trained such a sample towards nothing."""
    rewards = outcome_token_rewards(torch.tensor([1.0]), torch.ones(1, 4))
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    adv, returns = gae(rewards, torch.zeros(1, 4), mask, gamma=1.0, lam=1.0)
    # As the response without the reply, whose last token holds the reward: [1.0, 1.0].
    assert adv[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert returns[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0])


def test_clipped_value_loss_by_hand() -> None:
    # V moved 0.5 -> 1.0, clipped to 0.7; target 0.8: max((0.2)^2, (0.1)^2) / 2
    assert clipped_value_loss(torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([0.8]), 0.2).item() == (
        pytest.approx(0.02)
    )
    # V moved 1.0 -> 0.5, clipped to 0.8; target 1.2: max((0.7)^2, (0.4)^2) / 2
    assert clipped_value_loss(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([1.2]), 0.2).item() == (
        pytest.approx(0.245)
    )


def test_gae_steps_over_tokens_the_policy_did_not_sample() -> None:
    """A tool's reply inside a response (loss mask 0) is no action of the policy, and the critic is never
    trained on its positions: the model tokens around it are one another's neighbours, as in verl."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, -4.0, 0.8]])  # whatever the untrained values at the tool's tokens are
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # The same as the response without the tool's reply, [0.0, 1.0] with values [0.5, 0.8] above.
    assert adv[0].tolist() == pytest.approx([0.4, 0.0, 0.0, 0.2])
    assert returns[0].tolist() == pytest.approx([0.9, 0.0, 0.0, 1.0])
