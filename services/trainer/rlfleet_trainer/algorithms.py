"""The registry of RL algorithms by name: how each turns rewards into advantages and which
surrogate it clips. `rlfleet.run_spec.ALGORITHMS` (validated at submit) names exactly these.

What the algorithms share (clip ranges, KL to the reference as a loss or a reward, TIS, ratio
band, entropy bonus, loss aggregation) comes from the RunSpec; the defaults that make an
algorithm itself (DAPO's clip-higher and token-mean, Dr.GRPO's constant normaliser, ...) are
filled in by `rlfleet.run_spec.resolve`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlfleet_trainer.advantages import (
    OutcomeEstimator,
    gae,
    group_centered,
    group_normalized,
    leave_one_out,
    outcome_token_rewards,
    per_group,
    reinforce_pp,
    whiten,
)


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an advantage estimator sees, on the (S, T) grid of one step's sequences."""

    rewards: torch.Tensor  # (S,) outcome reward of each sequence
    groups: torch.Tensor  # (S,) index of each sequence's group (prompt)
    mask: torch.Tensor  # (S, T) trained response tokens
    present: torch.Tensor  # (S, T) response tokens
    kl: torch.Tensor  # (S, T) KL(rollout || reference) of each trained token when the KL goes into the reward, else 0
    kl_coef: float
    values: torch.Tensor | None = None  # (S, T) critic values, for GAE
    gamma: float = 1.0
    gae_lambda: float = 1.0


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor  # (S, T)
    returns: torch.Tensor | None = None  # (S, T) value targets, for the critic


AdvantageFn = Callable[[AdvantageInputs], Advantages]


@dataclass(frozen=True)
class Algorithm:
    advantages: AdvantageFn
    sequence_ratio: bool = False
    """Clip the sequence-level ratio (GSPO) instead of each token's."""
    critic: bool = False
    """Needs a value function (PPO)."""


def outcome(estimator: OutcomeEstimator) -> AdvantageFn:
    """Sequence-level advantages from each group's rewards (less beta * the sequence's KL when
    the KL is in the reward), given to every token of the response."""

    def advantages(x: AdvantageInputs) -> Advantages:
        scores = x.rewards - x.kl_coef * (x.kl * x.present).sum(dim=1)  # (S,)
        return Advantages(per_group(scores, x.groups, estimator).unsqueeze(1) * x.present)

    return advantages


def reinforce_pp_advantages(x: AdvantageInputs) -> Advantages:
    """REINFORCE++: returns of the outcome reward less per-token KL, whitened over the batch."""
    return Advantages(reinforce_pp(x.rewards, x.kl, x.kl_coef, x.mask, x.present))


def reinforce_pp_baseline_advantages(x: AdvantageInputs) -> Advantages:
    """REINFORCE++-baseline: the same with each group's mean reward subtracted first."""
    scores = per_group(x.rewards, x.groups, group_centered)  # (S,)
    return Advantages(reinforce_pp(scores, x.kl, x.kl_coef, x.mask, x.present))


def gae_advantages(x: AdvantageInputs) -> Advantages:
    """PPO: GAE over per-token rewards (outcome on the last token, less beta * KL per token) and
    the critic's values; advantages whitened over the batch, returns kept raw as value targets."""
    assert x.values is not None, "GAE needs the critic's values"
    token_rewards = outcome_token_rewards(x.rewards, x.present) - x.kl_coef * x.kl * x.present  # (S, T)
    adv, returns = gae(token_rewards, x.values, x.mask, x.gamma, x.gae_lambda)
    return Advantages(whiten(adv, x.mask), returns)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(outcome(group_normalized)),
    "dr_grpo": Algorithm(outcome(group_centered)),
    "dapo": Algorithm(outcome(group_normalized)),
    "gspo": Algorithm(outcome(group_normalized), sequence_ratio=True),
    "rloo": Algorithm(outcome(leave_one_out)),
    "reinforce_pp": Algorithm(reinforce_pp_advantages),
    "reinforce_pp_baseline": Algorithm(reinforce_pp_baseline_advantages),
    "ppo": Algorithm(gae_advantages, critic=True),
}
