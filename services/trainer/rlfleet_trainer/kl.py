"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of the sampled tokens.

With log_ratio = logp_ref - logp (tokens sampled from pi):
- k1 = -log_ratio                        unbiased, high variance, can be negative
- k2 = log_ratio**2 / 2                  biased, low variance
- k3 = exp(log_ratio) - log_ratio - 1    unbiased, low variance, always >= 0 (Schulman's k3)
- low_var_kl = k3 clamped to [-10, 10]   k3 with the clamp used by verl for stability
"""

from __future__ import annotations

import torch


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """logp, ref_logp: (B, T) -> (B, T) per-token KL estimate."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator in ("k3", "low_var_kl"):
        k3 = torch.exp(log_ratio) - log_ratio - 1
        return k3.clamp(-10.0, 10.0) if estimator == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2, k3 or low_var_kl")
