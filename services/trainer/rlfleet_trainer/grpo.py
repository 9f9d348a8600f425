"""The GRPO policy loss.

For response token t of sample i, with rollout log-probability logp_old (from the engine that
generated it), the current log-probability logp and the sample's advantage A_i:

    ratio_t   = exp(logp_t - logp_old_t)
    pg_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)
    loss_t    = pg_t + beta * KL_t(pi || pi_ref) - entropy_coef * H_t
    loss      = mean over samples of (mean over the sample's trained tokens of loss_t)

Tokens with loss mask 0 (padding, tool output) contribute nothing. Averaging per sample first, then
over samples, is the GRPO paper's aggregation: every response counts equally whatever its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet_trainer.kl import kl_penalty


@dataclass(frozen=True)
class GrpoConfig:
    clip_low: float = 0.2
    """Lower clip range: ratios below 1 - clip_low stop contributing gradient for A < 0."""
    clip_high: float = 0.2
    """Upper clip range: ratios above 1 + clip_high stop contributing gradient for A > 0."""
    kl_coef: float = 0.0
    """beta; 0 disables the KL term (and the reference model)."""
    kl_estimator: str = "k3"
    """k1, k2, k3 or low_var_kl (see kl.py)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""


def masked_mean_per_row(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T), (B, T) -> (B,): mean over each row's masked-in positions (0 for an empty row)."""
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def grpo_loss(
    logp: torch.Tensor,  # (B, T) current policy log-probs of the response tokens
    old_logp: torch.Tensor,  # (B, T) rollout log-probs of the same tokens
    advantages: torch.Tensor,  # (B,) one advantage per sample
    mask: torch.Tensor,  # (B, T) 1.0 where the token is trained on
    config: GrpoConfig,
    ref_logp: torch.Tensor | None = None,  # (B, T) reference policy log-probs, needed when kl_coef > 0
    entropy: torch.Tensor | None = None,  # (B, T) per-token entropy, needed when entropy_coef > 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns the loss summed over the B samples of this micro-batch (the caller divides by the
    global number of samples, so micro-batches add up to the per-sample mean) and detached
    per-micro-batch statistics (sums over samples, same convention)."""
    mask = mask.to(logp.dtype)
    adv = advantages.unsqueeze(1)  # (B, 1)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    stats: dict[str, torch.Tensor] = {}
    if config.kl_coef > 0:
        assert ref_logp is not None, "kl_coef > 0 needs the reference log-probs"
        kl = kl_penalty(logp, ref_logp, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = masked_mean_per_row(kl.detach(), mask).sum()
    if config.entropy_coef != 0:
        assert entropy is not None, "entropy_coef != 0 needs the per-token entropy"
        per_token = per_token - config.entropy_coef * entropy
    loss = masked_mean_per_row(per_token, mask).sum()
    with torch.no_grad():
        stats["pg_clipfrac"] = masked_mean_per_row((unclipped != clipped).to(logp.dtype), mask).sum()
        # Schulman's k3 estimate of KL(old || new) with r = new/old: (r - 1) - log r >= 0.
        stats["approx_kl"] = masked_mean_per_row(ratio - 1 - log_ratio, mask).sum()
        if entropy is not None:
            stats["entropy"] = masked_mean_per_row(entropy.detach(), mask).sum()
    return loss, stats
