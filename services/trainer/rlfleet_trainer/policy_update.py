"""One optimizer update of the policy (and of PPO's critic) on a part of a step's batch.

The part's sequences are packed into token-budget micro-batches over the ranks (data_parallel.py)
and accumulate gradients: each adds its loss numerator divided by the part's own denominator
(aggregation.py), so the result equals one pass over the part. The gradient is clipped, then the
optimizer and the learning-rate schedule step; PPO's critic steps its own optimizer on the clipped
value loss around the values the step started from. Advantages, returns, those values and the
pre-update log-probs come from the whole batch, computed before the step's first update.

A gradient whose norm is not finite (an overflow in the model's own numerics) would make every weight
and the optimizer's moments NaN for good, and the NaN weights would reach the fleet: the update is
skipped, as Megatron and verl do, and the learning-rate schedule waits for the next update taken. The
norm is the whole model's on every rank, so all ranks skip together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from rlfleet_trainer.aggregation import denominator, numerator
from rlfleet_trainer.batch import TrainSequence
from rlfleet_trainer.critic import clipped_value_loss
from rlfleet_trainer.data_parallel import (
    MicroBatchPlan,
    Ranks,
    micro_batch,
    rank_plan,
    sum_gradients_over_ranks,
    sum_over_ranks,
)
from rlfleet_trainer.policy import token_logprobs
from rlfleet_trainer.policy_loss import policy_loss

if TYPE_CHECKING:  # train_step imports this module
    from rlfleet_trainer.train_step import StepConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchTargets:
    """What every update of a step trains towards, on the (S, T) grid of the whole batch, fixed
    before the first update."""

    advantages: torch.Tensor  # (S, T)
    mask: torch.Tensor  # (S, T) trained response tokens
    returns: torch.Tensor | None = None  # (S, T) value targets (ppo)
    old_values: torch.Tensor | None = None  # (S, T) the critic's values before the step (ppo)
    pre_update_logp: torch.Tensor | None = None  # (S, T) the policy's log-probs before the step's first update


@dataclass(frozen=True)
class UpdateResult:
    """One update's figures, summed over ranks."""

    loss: float
    """The part's aggregated policy loss."""
    value_loss: float
    grad_norm: float
    """Before clipping; not finite when the update was skipped."""
    skipped: bool
    stats: dict[str, float]
    """policy_loss's statistics, summed over the part's sequences."""
    logprob_diff_sum: float
    """sum of |trainer - rollout| log-prob over the part's trained tokens."""
    tokens: int
    slots: int
    micro_batches: int


def part_plan(
    sequences: Sequence[TrainSequence], part: Sequence[int], config: StepConfig, ranks: Ranks
) -> list[MicroBatchPlan]:
    """This rank's micro-batches of the part, as rows of indices into `sequences` (None: idle)."""
    local = rank_plan(
        [len(sequences[i].tokens) for i in part], config.micro_batch_tokens, config.pack_row_tokens, ranks
    )
    return [None if rows is None else [[part[j] for j in row] for row in rows] for rows in local]


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sequences: Sequence[TrainSequence],
    part: Sequence[int],
    targets: BatchTargets,
    config: StepConfig,
    ranks: Ranks,
    ref_model: torch.nn.Module | None = None,
) -> UpdateResult:
    """One optimizer update on `sequences[i] for i in part` (every rank passes the same part)."""
    part_mask = targets.mask[list(part)]  # (P, T)
    trained_tokens = float(part_mask.sum())
    # A response with no trained token (truncated under rollout.truncated "mask") adds nothing and, as in verl,
    # does not count among the sequences either: it would shrink every other response's share.
    trained_sequences = int((part_mask.sum(dim=1) > 0).sum())
    norm = denominator(config.loss.aggregation, trained_sequences, trained_tokens)
    critic = config.critic
    optimizer.zero_grad(set_to_none=True)
    if critic is not None:
        critic.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    loss_sum, value_loss_sum, diff_sum, tokens, slots, micro_batches = 0.0, 0.0, 0.0, 0, 0, 0
    for rows in part_plan(sequences, part, config, ranks):
        batch = micro_batch(sequences, rows, config.pad_id)
        ids, width = batch.seq_ids, batch.mask.shape[1]
        scored = token_logprobs(model, batch, config.temperature, with_entropy=True, with_hidden=critic is not None)
        ref_logp: torch.Tensor | None = None
        if config.loss.kl_coef > 0:
            assert ref_model is not None, "a KL loss needs a reference model"
            with torch.no_grad():
                ref_logp = token_logprobs(ref_model, batch, config.temperature).logp
        before = targets.pre_update_logp
        loss, stats = policy_loss(
            scored.logp,
            batch.old_logp,
            targets.advantages[ids, :width],
            batch.mask,
            config.loss,
            ref_logp,
            scored.entropy,
            None if before is None else before[ids, :width],
        )
        (loss / norm).backward()
        if critic is not None and targets.old_values is not None and targets.returns is not None:
            assert scored.hidden is not None
            per_token = clipped_value_loss(
                critic.values(scored.hidden),
                targets.old_values[ids, :width],
                targets.returns[ids, :width],
                critic.value_clip,
            )
            value_loss = numerator(per_token, batch.mask, "token_mean", 1) / max(1.0, trained_tokens)
            value_loss.backward()
            value_loss_sum += float(value_loss.detach())
        loss_sum += float(loss.detach())
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + float(value)
        with torch.no_grad():
            diff_sum += float(((scored.logp - batch.old_logp).abs() * batch.mask).sum())
        if rows is not None:
            tokens += batch.tokens
            slots += int(batch.input_ids.numel())
            micro_batches += 1
    names = sorted(sums)
    loss_total, value_loss_total, diff_total, tokens_total, slots_total, batches_total, *stat_totals = sum_over_ranks(
        [loss_sum, value_loss_sum, diff_sum, tokens, slots, micro_batches, *(sums[n] for n in names)], ranks
    )
    clip = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if isinstance(grad_norm, DTensor):  # a sharded model's norm: each rank holds a part of the sum
        grad_norm = grad_norm.full_tensor()
    skipped = not math.isfinite(float(grad_norm))
    if skipped:
        logger.warning("gradient norm is %s: this optimizer update is skipped", float(grad_norm))
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        scheduler.step()
    if critic is not None:
        sum_gradients_over_ranks(critic.head, ranks)
        critic_norm = torch.nn.utils.clip_grad_norm_(critic.head.parameters(), clip)
        if skipped or not math.isfinite(float(critic_norm)):
            critic.optimizer.zero_grad(set_to_none=True)
        else:
            critic.optimizer.step()
    return UpdateResult(
        loss=loss_total / norm,
        value_loss=value_loss_total,
        grad_norm=float(grad_norm),
        skipped=skipped,
        stats=dict(zip(names, stat_totals, strict=True)),
        logprob_diff_sum=diff_total,
        tokens=int(tokens_total),
        slots=int(slots_total),
        micro_batches=int(batches_total),
    )
