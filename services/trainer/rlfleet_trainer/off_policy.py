"""Off-policy correction with the rollout log-probs: the engines' numerics (and, with staleness,
their weights) differ from the trainer's, so tokens are reweighted or left out.

With rho_t = pi_train(y_t) / pi_rollout(y_t) taken before the update (no gradient):
- truncated importance sampling (TIS): each token's loss is weighted by min(rho_t, C);
- ratio band masking: tokens with rho_t < low or rho_t > high get loss mask 0.
"""

from __future__ import annotations

import torch

from rlfleet_trainer.ratios import ratio_from_log


def tis_weights(logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """w_t = min(exp(logp_t - logp_rollout_t), C). logp, rollout_logp: (B, T) -> (B, T), no gradient."""
    return ratio_from_log(logp.detach() - rollout_logp).clamp(max=cap)


def ratio_band_mask(logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1.0 where low <= rho_t <= high, else 0.0; a bound of 0 is off. (B, T) -> (B, T)."""
    ratio = ratio_from_log(logp.detach() - rollout_logp)  # (B, T)
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if low > 0:
        keep &= ratio >= low
    if high > 0:
        keep &= ratio <= high
    return keep.to(logp.dtype)
