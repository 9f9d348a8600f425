"""Group-relative advantages (GRPO): each sample's reward against the other samples of its prompt."""

from __future__ import annotations

import torch


def group_normalized_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    rewards: (G, n) — G groups of n samples each. Returns (G, n). A group whose rewards are all equal
    gets zero advantages: it carries no signal about which response is better.
    """
    assert rewards.dim() == 2, f"rewards must be (groups, n), got {tuple(rewards.shape)}"
    mean = rewards.mean(dim=1, keepdim=True)  # (G, 1)
    centered = rewards - mean  # (G, n)
    if not scale_by_std:
        return centered
    std = rewards.std(dim=1, keepdim=True, unbiased=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    # An all-equal group has centered == 0 already; keep it 0 even when eps is 0.
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
