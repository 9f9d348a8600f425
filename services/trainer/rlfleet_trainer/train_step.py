"""One optimizer step of the run's algorithm over a global batch of SampleGroups.

1. The step's sequences are packed into token-budget micro-batches (batch.py).
2. When the KL goes into the reward, or PPO's critic needs values, a gradient-free pass scores
   every micro-batch first: advantages (REINFORCE++'s whitening, GAE) need the whole batch.
3. Advantages come from the algorithm (algorithms.py), scaled by each group's weight.
4. Micro-batches accumulate gradients: each adds its loss numerator divided by the global batch's
   denominator (aggregation.py), so the result equals one pass over the whole batch. The gradient
   is clipped, the optimizer and the schedule step; PPO's critic steps its own optimizer.

Under a process group every rank gets the whole batch and trains on its share of the sequences
(data_parallel.py): the gradient-free pass fills each rank's rows of the KL and value grids and a
sum gives every rank the whole grids, so advantages are those of the whole batch; FSDP sums the
policy's gradients over ranks, the critic's are summed here, and metrics are summed to global
values. One rank (or none) computes exactly what it always did.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_trainer.aggregation import denominator, numerator
from rlfleet_trainer.algorithms import ALGORITHMS, AdvantageInputs, Algorithm
from rlfleet_trainer.batch import TRAINABLE, TrainSequence, sequences_from_groups
from rlfleet_trainer.critic import Critic, clipped_value_loss
from rlfleet_trainer.data_parallel import (
    current_ranks,
    micro_batch,
    rank_plan,
    sum_gradients_over_ranks,
    sum_over_ranks,
    sum_tensor_over_ranks,
)
from rlfleet_trainer.kl import kl_penalty
from rlfleet_trainer.policy import token_logprobs
from rlfleet_trainer.policy_loss import PolicyLossConfig, policy_loss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepConfig:
    algorithm: Algorithm
    loss: PolicyLossConfig
    temperature: float
    """Sampling temperature of the rollouts: log-probs are taken under softmax(logits / T)."""
    micro_batch_tokens: int
    grad_clip: float
    """Max gradient norm; 0 disables clipping."""
    pad_id: int
    pack_row_tokens: int = 0
    """Length of a packed row; 0: the longest sequence of the step."""
    reward_kl_coef: float = 0.0
    """beta of the KL subtracted from the reward (0 when the KL is off or in the loss)."""
    kl_estimator: str = "k3"
    gamma: float = 1.0
    gae_lambda: float = 0.95
    critic: Critic | None = None
    """PPO's value head; it carries its own weights and optimizer from step to step."""


def step_config_from_spec(spec: RunSpec, model: PreTrainedModel, pad_id: int) -> StepConfig:
    """The step a resolved RunSpec asks for; builds PPO's critic on `model`'s hidden size."""
    al, tr = spec.algorithm, spec.trainer
    algorithm = ALGORITHMS[al.name]
    in_loss = al.kl_mode == "loss"
    critic = None
    if algorithm.critic:
        critic = Critic(int(model.config.hidden_size), al.critic_learning_rate, al.value_clip)
    return StepConfig(
        algorithm=algorithm,
        loss=PolicyLossConfig(
            clip_low=al.clip_low,
            clip_high=al.clip_high,
            clip_ratio_c=al.clip_ratio_c,
            sequence_ratio=algorithm.sequence_ratio,
            aggregation=al.loss_aggregation,
            max_tokens=spec.rollout.sampling.max_new_tokens,
            kl_coef=al.kl_coef if in_loss else 0.0,
            kl_estimator=al.kl_estimator,
            entropy_coef=al.entropy_coef,
            tis_cap=al.tis_cap,
            ratio_mask_low=al.ratio_mask_low,
            ratio_mask_high=al.ratio_mask_high,
        ),
        temperature=spec.rollout.sampling.temperature,
        micro_batch_tokens=tr.micro_batch_tokens,
        grad_clip=tr.grad_clip,
        pad_id=pad_id,
        pack_row_tokens=tr.pack_row_tokens,
        reward_kl_coef=0.0 if in_loss else al.kl_coef,
        kl_estimator=al.kl_estimator,
        gamma=al.gamma,
        gae_lambda=al.gae_lambda,
        critic=critic,
    )


def response_grid(sequences: Sequence[TrainSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, present), both (S, T): trained and all response tokens of every sequence."""
    width = max(s.response_len for s in sequences)
    mask = torch.zeros(len(sequences), width)
    present = torch.zeros(len(sequences), width)
    for i, seq in enumerate(sequences):
        mask[i, : seq.response_len] = torch.tensor(seq.mask, dtype=torch.float32)
        present[i, : seq.response_len] = 1.0
    return mask, present


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    groups: Sequence[SampleGroup],
    config: StepConfig,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Trains on `groups`; returns the step's metrics (loss, pg_clipfrac, approx_kl, entropy,
    grad_norm, lr, logprob_diff = mean |trainer - rollout| log-prob over trained tokens, ...)."""
    started = time.perf_counter()
    sequences = sequences_from_groups(groups)
    rewards = [s.reward for g in groups for s in g.samples if s.status in TRAINABLE]  # failed ones have none
    metrics: dict[str, float] = {
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "samples": float(len(sequences)),
        "lr": float(scheduler.get_last_lr()[0]),
    }
    if not sequences:
        metrics["skipped"] = 1.0
        return metrics
    ranks = current_ranks()
    # This rank's micro-batches; None marks an idle one that only joins the collectives.
    plan = rank_plan([len(s.tokens) for s in sequences], config.micro_batch_tokens, config.pack_row_tokens, ranks)
    mask, present = response_grid(sequences)  # (S, T)
    kl = torch.zeros_like(mask)
    values = torch.zeros_like(mask) if config.critic is not None else None
    if config.reward_kl_coef > 0 or values is not None:
        with torch.no_grad():
            for rows in plan:
                batch = micro_batch(sequences, rows, config.pad_id)
                ids, width = batch.seq_ids, batch.mask.shape[1]
                if config.reward_kl_coef > 0:
                    assert ref_model is not None, "a KL in the reward needs a reference model"
                    reference = token_logprobs(ref_model, batch, config.temperature).logp
                    if rows is not None:
                        # Only tokens the policy sampled: others (a tool's reply) carry a placeholder rollout
                        # log-prob, whose "KL" would penalise the response for text it did not write.
                        kl[ids, :width] = kl_penalty(batch.old_logp, reference, config.kl_estimator) * batch.mask
                if values is not None and config.critic is not None:
                    hidden = token_logprobs(model, batch, config.temperature, with_hidden=True).hidden
                    assert hidden is not None
                    if rows is not None:
                        values[ids, :width] = config.critic.values(hidden) * batch.present
        sum_tensor_over_ranks(kl, ranks)
        if values is not None:
            sum_tensor_over_ranks(values, ranks)
    estimate = config.algorithm.advantages(
        AdvantageInputs(
            rewards=torch.tensor([s.reward for s in sequences], dtype=torch.float32),
            groups=torch.tensor([s.group for s in sequences]),
            mask=mask,
            present=present,
            kl=kl,
            kl_coef=config.reward_kl_coef,
            values=values,
            gamma=config.gamma,
            gae_lambda=config.gae_lambda,
        )
    )
    advantages = estimate.advantages * torch.tensor([s.weight for s in sequences]).unsqueeze(1)  # (S, T)
    trained_tokens = float(mask.sum())
    # A response with no trained token (truncated under rollout.truncated "mask") adds nothing and, as in verl,
    # does not count among the sequences either: it would shrink every other response's share.
    trained_sequences = int((mask.sum(dim=1) > 0).sum())
    norm = denominator(config.loss.aggregation, trained_sequences, trained_tokens)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    critic = config.critic
    if critic is not None:
        critic.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = defaultdict(float)
    loss_sum, value_loss_sum, diff_sum, tokens, slots, micro_batches = 0.0, 0.0, 0.0, 0, 0, 0
    for rows in plan:
        batch = micro_batch(sequences, rows, config.pad_id)
        ids, width = batch.seq_ids, batch.mask.shape[1]
        scored = token_logprobs(model, batch, config.temperature, with_entropy=True, with_hidden=critic is not None)
        ref_logp: torch.Tensor | None = None
        if config.loss.kl_coef > 0:
            assert ref_model is not None, "a KL loss needs a reference model"
            with torch.no_grad():
                ref_logp = token_logprobs(ref_model, batch, config.temperature).logp
        loss, stats = policy_loss(
            scored.logp, batch.old_logp, advantages[ids, :width], batch.mask, config.loss, ref_logp, scored.entropy
        )
        (loss / norm).backward()
        if critic is not None and values is not None and estimate.returns is not None and scored.hidden is not None:
            per_token = clipped_value_loss(
                critic.values(scored.hidden), values[ids, :width], estimate.returns[ids, :width], critic.value_clip
            )
            value_loss = numerator(per_token, batch.mask, "token_mean", 1) / max(1.0, trained_tokens)
            value_loss.backward()
            value_loss_sum += float(value_loss.detach())
        loss_sum += float(loss.detach())
        for name, value in stats.items():
            sums[name] += float(value)
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
    # A gradient that is not finite (an overflow in the model's own numerics) would make every weight and the
    # optimizer's moments NaN for good, and the NaN weights would reach the fleet: the update is skipped, as
    # Megatron and verl do; the learning-rate schedule waits for the next update taken, as in Megatron. The norm
    # is the whole model's on every rank, so all ranks skip together.
    skipped = not math.isfinite(float(grad_norm))
    if skipped:
        logger.warning("gradient norm is %s: this step's optimizer update is skipped", float(grad_norm))
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
        metrics["value_loss"] = value_loss_total
    metrics["update_skipped"] = float(skipped)
    elapsed = time.perf_counter() - started
    metrics.update({name: value / len(sequences) for name, value in zip(names, stat_totals, strict=True)})
    metrics.update(
        {
            "loss": loss_total / norm,
            "grad_norm": float(grad_norm),
            "logprob_diff": diff_total / max(1.0, trained_tokens),
            "advantage_abs_mean": float((advantages.abs() * mask).sum()) / max(1.0, trained_tokens),
            "tokens": float(tokens_total),
            "pack_efficiency": tokens_total / max(1, slots_total),
            "micro_batches": float(batches_total),
            "step_seconds": elapsed,
            "tokens_per_second": tokens_total / elapsed if elapsed > 0 else 0.0,
        }
    )
    return metrics
