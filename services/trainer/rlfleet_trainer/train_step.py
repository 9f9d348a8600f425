"""One GRPO optimizer step over a global batch of SampleGroups.

Micro-batches accumulate gradients so that the result equals one pass over the whole batch:
each micro-batch's loss is a sum over its samples, divided by the global sample count.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_trainer.batch import collate, micro_batches, sequences_from_groups
from rlfleet_trainer.grpo import GrpoConfig, grpo_loss
from rlfleet_trainer.policy import token_logprobs


@dataclass(frozen=True)
class StepConfig:
    grpo: GrpoConfig
    temperature: float
    """Sampling temperature of the rollouts: log-probs are taken under softmax(logits / T)."""
    micro_batch_tokens: int
    grad_clip: float
    """Max gradient norm; 0 disables clipping."""
    pad_id: int


def grpo_step(
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
    rewards = [s.reward for g in groups for s in g.samples]
    metrics: dict[str, float] = {
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "samples": float(len(sequences)),
        "lr": float(scheduler.get_last_lr()[0]),
    }
    if not sequences:
        metrics["skipped"] = 1.0
        return metrics
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = len(sequences)
    sums: dict[str, float] = defaultdict(float)
    diff_sum, trained_tokens, tokens = 0.0, 0.0, 0
    for chunk in micro_batches(sequences, config.micro_batch_tokens):
        batch = collate(chunk, config.pad_id)
        logp, entropy = token_logprobs(model, batch, config.temperature, with_entropy=True)
        ref_logp = None
        if config.grpo.kl_coef > 0:
            assert ref_model is not None, "kl_coef > 0 needs a reference model"
            with torch.no_grad():
                ref_logp, _ = token_logprobs(ref_model, batch, config.temperature)
        loss, stats = grpo_loss(logp, batch.old_logp, batch.advantages, batch.mask, config.grpo, ref_logp, entropy)
        (loss / total).backward()
        sums["loss"] += float(loss.detach())
        for name, value in stats.items():
            sums[name] += float(value)
        with torch.no_grad():
            diff_sum += float(((logp - batch.old_logp).abs() * batch.mask).sum())
            trained_tokens += float(batch.mask.sum())
        tokens += int(batch.attention_mask.sum())
    clip = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    elapsed = time.perf_counter() - started
    metrics.update({name: value / total for name, value in sums.items()})
    metrics.update(
        {
            "grad_norm": float(grad_norm),
            "logprob_diff": diff_sum / max(1.0, trained_tokens),
            "tokens": float(tokens),
            "step_seconds": elapsed,
            "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
        }
    )
    return metrics
