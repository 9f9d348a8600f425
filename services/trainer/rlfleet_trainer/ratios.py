"""Probability ratios pi_a / pi_b from log-probability differences.

The log-ratio is bounded to [-20, 20] before the exponential, as verl does: a token the engine sampled
at log-prob -100 that the trainer now finds likely would otherwise give exp(99) = inf in float32, an
infinite loss and NaN gradients. e^20 (about 5e8) is still far past every clip, cap and band.
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0


def ratio_from_log(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with log_ratio clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND]; (B, T) -> (B, T)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
