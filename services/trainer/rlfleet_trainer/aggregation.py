"""Loss aggregation: how the per-token losses of a global batch become one number.

    seq_mean_token_mean:     (1/S) sum_i (1/|y_i|) sum_t l_it     every response counts the same (GRPO)
    token_mean:              (1/N) sum_i sum_t l_it               every token counts the same (DAPO)
    seq_mean_token_sum_norm: (1/S) sum_i (1/L_max) sum_t l_it     token sums over a constant (Dr.GRPO)

with S the sequences with at least one trained token (as in verl: a fully masked response, such as a
truncated one under rollout.truncated "mask", would shrink every other one's share), N the trained
tokens of the whole step and L_max the generation budget.
A micro-batch adds its `numerator` to the gradient as numerator / `denominator` of the global
batch, so gradient accumulation over micro-batches equals one pass over the whole batch.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


def masked_mean_per_row(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T), (B, T) -> (B,): mean over each row's masked-in positions (0 for an empty row)."""
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def numerator(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int) -> torch.Tensor:
    """per_token, mask: (B, T) -> scalar: this micro-batch's share of the aggregated loss, before
    the division by `denominator`."""
    if mode == "seq_mean_token_mean":
        return masked_mean_per_row(per_token, mask).sum()
    if mode == "token_mean":
        return (per_token * mask).sum()
    if mode == "seq_mean_token_sum_norm":
        return (per_token * mask).sum() / max_tokens
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {list(AGGREGATIONS)}")


def denominator(mode: str, sequences: int, trained_tokens: float) -> float:
    """The global batch's normaliser: sequences, or trained tokens for token_mean (at least 1)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {list(AGGREGATIONS)}")
    return max(1.0, float(trained_tokens if mode == "token_mean" else sequences))
