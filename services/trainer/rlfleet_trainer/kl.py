"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of the sampled tokens.

With log_ratio = logp_ref - logp (tokens sampled from pi):
- k1 = -log_ratio                        unbiased, high variance, can be negative
- k2 = log_ratio**2 / 2                  biased, low variance
- k3 = exp(log_ratio) - log_ratio - 1    low variance, always >= 0 (Schulman's k3), clamped to [-10, 10]
- low_var_kl                             the same (verl's name for it)

k3 is clamped as verl and OpenRLHF clamp it, and its log-ratio bounded before the exponential
(ratios.py): one token the reference finds far likelier than the policy (log-ratio 12 gives a k3 of
about 1.6e5) would otherwise outweigh the rest of the batch, in the loss or, through the reward,
in every whitened advantage; at log-ratio 100 the value is inf and the gradient NaN.
"""

from __future__ import annotations

import torch

from rlfleet_trainer.ratios import ratio_from_log

K3_BOUND = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """logp, ref_logp: (B, T) -> (B, T) per-token KL estimate."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator in ("k3", "low_var_kl"):
        return (ratio_from_log(log_ratio) - log_ratio - 1).clamp(-K3_BOUND, K3_BOUND)
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2, k3 or low_var_kl")
