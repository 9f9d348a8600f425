"""The policy loss: a clipped surrogate (per token, or per sequence for GSPO), plus the KL to the
reference, minus the entropy bonus, with off-policy correction, aggregated over the batch.

For response token t of sample i, with old log-probability logp_old and advantage A_it:

    ratio_t = exp(logp_t - logp_old_t)   (the log-ratio bounded to [-20, 20]: ratios.py)
    pg_t    = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    pg_t    = min(pg_t, -c * A_t)  where A_t < 0   (dual clip, c = clip_ratio_c; off at 0)
    loss_t  = w_t * pg_t + beta * KL_t(pi || pi_ref) - entropy_coef * H_t

where w_t is the TIS weight (1 without TIS) and tokens outside the ratio band are masked out.
logp_old is the rollout log-prob; with TIS it is the trainer's own log-prob before the step's first
update (so the ratio only clips what the step's updates themselves move: nothing in the first update,
where it is 1) and the rollout mismatch goes into w_t. The TIS weight and the ratio band compare that
same pre-update log-prob with the rollout's, so they stay fixed over the step's updates.
Tokens with loss mask 0 (padding, tool output) contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet_trainer.aggregation import masked_mean_per_row, numerator
from rlfleet_trainer.kl import kl_penalty
from rlfleet_trainer.off_policy import ratio_band_mask, tis_weights
from rlfleet_trainer.ratios import ratio_from_log


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_low: float = 0.2
    """Lower clip range: ratios below 1 - clip_low stop contributing gradient for A < 0."""
    clip_high: float = 0.2
    """Upper clip range: ratios above 1 + clip_high stop contributing gradient for A > 0."""
    clip_ratio_c: float = 0.0
    """Dual clip: for A < 0 the loss is at most c |A| (ratios above c stop contributing gradient); 0 is off."""
    sequence_ratio: bool = False
    """GSPO: clip the geometric mean of a sequence's token ratios instead of each token's ratio."""
    aggregation: str = "seq_mean_token_mean"
    """See aggregation.py."""
    max_tokens: int = 1
    """L_max of seq_mean_token_sum_norm: the generation budget."""
    kl_coef: float = 0.0
    """beta of the KL loss term; 0 when the KL is off or goes into the reward instead."""
    kl_estimator: str = "k3"
    """k1, k2, k3 or low_var_kl (see kl.py)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    tis_cap: float = 0.0
    """C of truncated importance sampling; 0 disables TIS."""
    ratio_mask_low: float = 0.0
    """Tokens with pi_train / pi_rollout below this are left out; 0 disables."""
    ratio_mask_high: float = 0.0
    """Tokens with pi_train / pi_rollout above this are left out; 0 disables."""


def clipped_token_surrogate(
    logp: torch.Tensor,  # (B, T) current log-probs
    old_logp: torch.Tensor,  # (B, T) old-policy log-probs
    advantages: torch.Tensor,  # (B, T)
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: pg_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),
    r_t = exp(logp_t - logp_old_t), then, with dual clip (c > 0), pg_t = min(pg_t, -c A_t) where A_t < 0.
    Returns (pg (B, T), clipped (B, T) bool: the clipped branch won, dual_clipped (B, T) bool)."""
    ratio = ratio_from_log(logp - old_logp)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    dual_clipped = torch.zeros_like(pg, dtype=torch.bool)
    if clip_ratio_c > 0:
        bound = -clip_ratio_c * advantages
        dual_clipped = ((advantages < 0) & (pg > bound)).detach()
        pg = torch.where(dual_clipped, bound, pg)
    return pg, (clipped < unclipped).detach(), dual_clipped


def clipped_sequence_surrogate(
    logp: torch.Tensor,  # (B, T)
    old_logp: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B, T) constant along each sequence
    mask: torch.Tensor,  # (B, T)
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO's sequence-level surrogate: s_i = exp(mean_t(logp_it - logp_old_it)) (the geometric
    mean of the token ratios), pg_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    given to every token of sequence i. Returns (pg (B, T), clipped (B, T) bool)."""
    seq_ratio = ratio_from_log(masked_mean_per_row(logp - old_logp, mask)).unsqueeze(1)  # (B, 1)
    adv = masked_mean_per_row(advantages, mask).unsqueeze(1)  # (B, 1)
    unclipped = seq_ratio * adv
    clipped = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -torch.minimum(unclipped, clipped).expand_as(logp)  # (B, T)
    return pg, (clipped < unclipped).detach().expand_as(logp)


def policy_loss(
    logp: torch.Tensor,  # (B, T) current policy log-probs of the response tokens
    rollout_logp: torch.Tensor,  # (B, T) rollout log-probs of the same tokens
    advantages: torch.Tensor,  # (B, T) per-token advantages (a sample's advantage repeated for outcome rewards)
    mask: torch.Tensor,  # (B, T) 1.0 where the token is trained on
    config: PolicyLossConfig,
    ref_logp: torch.Tensor | None = None,  # (B, T) reference log-probs, needed when kl_coef > 0
    entropy: torch.Tensor | None = None,  # (B, T) per-token entropy, needed when entropy_coef != 0
    pre_update_logp: torch.Tensor | None = None,  # (B, T) the trainer's log-probs before the step's first update
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns this micro-batch's loss numerator (see aggregation.py: the caller divides by the
    global denominator) and detached statistics summed over the B samples of per-sample means.

    `pre_update_logp` is needed only when the step takes several updates and TIS, the ratio band or a sequence
    ratio (GSPO) is on; None means this is the step's only update, whose current log-probs are the pre-update
    ones."""
    mask = mask.to(logp.dtype)
    before = logp.detach() if pre_update_logp is None else pre_update_logp  # pi_train before the step's updates
    # GSPO's clip (3e-4) is far narrower than the engines' numerical mismatch with the trainer: against the
    # rollout's log-probs it silenced a quarter of the sequences of a bf16 fleet before the policy had moved. Its
    # old policy is the trainer's, as in verl and slime; a token-level ratio's clip is wide enough for either.
    old_logp = before if config.tis_cap > 0 or config.sequence_ratio else rollout_logp
    band: torch.Tensor | None = None
    if config.ratio_mask_low > 0 or config.ratio_mask_high > 0:
        band = ratio_band_mask(before, rollout_logp, config.ratio_mask_low, config.ratio_mask_high)
    if config.sequence_ratio:
        # A token the band leaves out takes no part in its sequence's ratio either: one outlier token pushed the
        # ratio past GSPO's narrow clip and silenced the whole sequence (or scaled its gradient up, itself included).
        in_ratio = mask if band is None else mask * band
        pg, clipped = clipped_sequence_surrogate(
            logp, old_logp, advantages, in_ratio, config.clip_low, config.clip_high
        )
        dual_clipped = None
    else:
        pg, clipped, dual_clipped = clipped_token_surrogate(
            logp, old_logp, advantages, config.clip_low, config.clip_high, config.clip_ratio_c
        )
    stats: dict[str, torch.Tensor] = {}
    trained = mask
    if config.tis_cap > 0:
        weights = tis_weights(before, rollout_logp, config.tis_cap)  # (B, T)
        pg = pg * weights
        stats["tis_weight"] = masked_mean_per_row(weights, mask).sum()
    per_token = pg  # (B, T)
    if config.kl_coef > 0:
        assert ref_logp is not None, "kl_coef > 0 needs the reference log-probs"
        kl = kl_penalty(logp, ref_logp, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = masked_mean_per_row(kl.detach(), mask).sum()
    if config.entropy_coef != 0:
        assert entropy is not None, "entropy_coef != 0 needs the per-token entropy"
        per_token = per_token - config.entropy_coef * entropy
    if band is not None:
        # The band zeroes tokens' losses; normalisers still count them, as tokens whose gradient is dropped.
        per_token = per_token * band
        trained = mask * band
        stats["ratio_masked_frac"] = masked_mean_per_row(1.0 - band, mask).sum()
    loss = numerator(per_token, mask, config.aggregation, config.max_tokens)
    with torch.no_grad():
        log_ratio = logp - rollout_logp
        stats["pg_clipfrac"] = masked_mean_per_row(clipped.to(logp.dtype), trained).sum()
        if dual_clipped is not None and config.clip_ratio_c > 0:
            stats["pg_dual_clipfrac"] = masked_mean_per_row(dual_clipped.to(logp.dtype), trained).sum()
        # Schulman's k3 estimate of KL(rollout || current) with r = current/rollout: (r - 1) - log r >= 0.
        stats["approx_kl"] = masked_mean_per_row(ratio_from_log(log_ratio) - 1 - log_ratio, mask).sum()
        if entropy is not None:
            stats["entropy"] = masked_mean_per_row(entropy.detach(), mask).sum()
    return loss, stats
