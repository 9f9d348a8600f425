"""Advantage estimators: how much better than expected each response (or token) turned out.

Outcome estimators give one advantage per sample from the rewards of its group (GRPO, Dr.GRPO,
RLOO); REINFORCE++ and GAE give one per token from per-token rewards. Grids are (S, T): the S
sequences of a step by their longest response, with `present` marking real response tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OutcomeEstimator = Callable[[torch.Tensor], torch.Tensor]


def _no_signal(rewards: torch.Tensor) -> bool:
    """A group of one, or whose rewards are all equal: nothing tells its responses apart, so every estimator
    gives it exactly 0. Tested as such, not through the mean: in float32 the mean of n equal rewards can be an
    ulp off (16 x 12.7), and GRPO's division by a std of the same size turned that into advantages of 0.1-0.5."""
    return rewards.numel() < 2 or bool((rewards == rewards[0]).all())


def group_normalized(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps), over the n rewards (n,) of one group, in float64.

    A group whose rewards are all equal gets zero advantages: it carries no signal about which
    response is better.
    """
    if _no_signal(rewards):
        return torch.zeros_like(rewards)
    r = rewards.double()
    return ((r - r.mean()) / (r.std(unbiased=True) + eps)).to(rewards.dtype)


def group_centered(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i - mean(r), no division by the std (which favours too-easy and too-hard
    prompts), over the n rewards (n,) of one group, in float64; 0 for an all-equal group."""
    if _no_signal(rewards):
        return torch.zeros_like(rewards)
    r = rewards.double()
    return (r - r.mean()).to(rewards.dtype)


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r)), over (n,) in float64; a group
    of one has no baseline and gets 0, as does an all-equal group."""
    if _no_signal(rewards):
        return torch.zeros_like(rewards)
    n, r = rewards.numel(), rewards.double()
    return (n / (n - 1) * (r - r.mean())).to(rewards.dtype)


def per_group(rewards: torch.Tensor, groups: torch.Tensor, estimator: OutcomeEstimator) -> torch.Tensor:
    """Applies `estimator` to each group's rewards. rewards, groups: (S,) -> (S,)."""
    out = torch.zeros_like(rewards)
    for group in groups.unique():
        members = groups == group
        out[members] = estimator(rewards[members])
    return out


def outcome_token_rewards(scores: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Places each sequence's score (S,) on its last response token: (S, T), 0 elsewhere."""
    last = (present.sum(dim=1).long() - 1).clamp(min=0)  # (S,)
    out = torch.zeros_like(present)
    out[torch.arange(present.shape[0]), last] = scores.to(present.dtype)
    return out * present


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} along each row of (S, T); G after the last token is 0."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # (S,)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = token_rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps), both over the masked-in entries of (S, T), in float64; 0 off the mask,
    and 0 everywhere when every masked-in value is equal (as `_no_signal` for a group). In float32 the mean of
    equal returns (a whole step scoring 0.1) was an ulp off, and the division by a std of the same size made
    advantages of up to 0.43 out of nothing; the eps under the root bounds what a near-constant batch is scaled
    by, as verl's and OpenRLHF's whitening do."""
    masked = values[mask.bool()]
    if masked.numel() == 0 or bool((masked == masked[0]).all()):
        return torch.zeros_like(values)
    v, m = values.double(), mask.double()
    count = m.sum()
    mean = (v * m).sum() / count
    var = ((v - mean).square() * m).sum() / count
    return ((v - mean) * torch.rsqrt(var + eps) * m).to(values.dtype)


def reinforce_pp(
    scores: torch.Tensor,  # (S,) the outcome reward of each sequence (group mean removed for the baseline variant)
    kl: torch.Tensor,  # (S, T) per-token KL to the reference, 0 when the KL is not in the reward
    kl_coef: float,
    mask: torch.Tensor,  # (S, T) trained tokens
    present: torch.Tensor,  # (S, T) response tokens
) -> torch.Tensor:
    """REINFORCE++: per-token reward r_t = -beta * KL_t (+ the score on the last token), return
    G_t = sum_{s >= t} r_s, advantages = G whitened over every trained token of the global batch."""
    token_rewards = outcome_token_rewards(scores, present) - kl_coef * kl * present  # (S, T)
    return whiten(discounted_returns(token_rewards, gamma=1.0), mask)


def gae(
    token_rewards: torch.Tensor,  # (S, T)
    values: torch.Tensor,  # (S, T) critic's V(s_t) at the position predicting token t
    mask: torch.Tensor,  # (S, T) tokens the policy sampled and is trained on
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, right to left with V after the last token = 0:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t            (the value target)

    where t + 1 is the next token in the mask: tokens off it (a tool's reply between turns) are no
    action of the policy, and the critic is never trained on their positions, so they are stepped over
    (as verl does), not bootstrapped from. Their rewards go to the token in the mask before them: a response
    ending on tokens off the mask (an environment's last reply) has its outcome reward there, which was lost,
    training PPO on nothing. Returns (advantages, returns), both (S, T) and 0 off the mask.
    """
    values = values * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # (S,) V of the next token in the mask
    next_adv = torch.zeros_like(values[:, 0])
    pending = torch.zeros_like(values[:, 0])  # (S,) rewards of the tokens off the mask after this one
    for t in range(values.shape[1] - 1, -1, -1):
        keep = mask[:, t]
        reward = token_rewards[:, t] + pending
        delta = reward + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        pending = torch.where(keep > 0, torch.zeros_like(reward), reward)
        next_value = torch.where(keep > 0, values[:, t], next_value)
        next_adv = torch.where(keep > 0, adv, next_adv)
        advantages[:, t] = adv * keep
    return advantages, (advantages + values) * mask
