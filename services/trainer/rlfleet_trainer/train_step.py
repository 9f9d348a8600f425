"""One training step of the run's algorithm over a global batch of SampleGroups: one or more
optimizer updates on it.

1. The step's sequences are packed into token-budget micro-batches (batch.py).
2. When the KL goes into the reward, PPO's critic needs values, or a step of several updates needs
   the policy's log-probs from before its first update (TIS and the ratio band compare them with the
   rollout's), a gradient-free pass scores every micro-batch first: advantages (REINFORCE++'s
   whitening, GAE) need the whole batch.
3. Advantages come from the algorithm (algorithms.py), scaled by each group's weight. They, PPO's
   returns and old values, and the pre-update log-probs stay fixed for the whole step.
4. `epochs` passes over the batch, each split into `mini_batches` parts (mini_batches.py), take one
   optimizer update per part (policy_update.py): micro-batches accumulate gradients against the
   part's loss denominator (aggregation.py), so the result equals one pass over the part; the
   gradient is clipped, the optimizer and the schedule step; PPO's critic steps its own optimizer.
   One part and one epoch (the default) is one update on the whole batch.

Under a process group every rank gets the whole batch and trains on its share of each part's
sequences (data_parallel.py): the gradient-free pass fills each rank's rows of the KL, value and
log-prob grids and a sum gives every rank the whole grids, so advantages are those of the whole
batch; FSDP sums the policy's gradients over ranks, the critic's are summed here, and metrics are
summed to global values. One rank (or none) computes exactly what it always did.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from rlfleet.v1.runs_pb2 import RunSpec, SamplingParams
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_trainer.algorithms import ALGORITHMS, AdvantageInputs, Algorithm
from rlfleet_trainer.batch import TRAINABLE, TrainSequence, sequences_from_groups
from rlfleet_trainer.critic import Critic
from rlfleet_trainer.data_parallel import Ranks, current_ranks, micro_batch, rank_plan, sum_tensor_over_ranks
from rlfleet_trainer.kl import kl_penalty
from rlfleet_trainer.mini_batches import mini_batch_parts
from rlfleet_trainer.policy import token_logprobs
from rlfleet_trainer.policy_loss import PolicyLossConfig
from rlfleet_trainer.policy_update import BatchTargets, UpdateResult, update_policy


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
    mini_batches: int = 1
    """Optimizer updates each pass over the batch is split into."""
    epochs: int = 1
    """Passes over the batch."""
    seed: int = 0
    """The run's seed: with the step and the epoch it seeds the order of the mini-batches."""

    def updates(self, sequences: int) -> int:
        """Optimizer updates a step of `sequences` sequences takes (a mini-batch needs one)."""
        return self.epochs * min(self.mini_batches, sequences)


# Below it an engine samples greedily, as SGLang does (its _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-6


def scoring_temperature(sampling: SamplingParams) -> float:
    """The temperature the rollouts' log-probs were taken at: 0 (plain softmax) when the engine sampled greedily,
    at a temperature under 1e-6 or with top_k 1, as SGLang reports a greedy token's log-prob from the logits
    unscaled; the trainer divided them by the spec's temperature, so on-policy data started off-policy (a ratio of
    1.03 at temperature 0.7 and top_k 1)."""
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    greedy = temperature < GREEDY_TEMPERATURE or (sampling.HasField("top_k") and sampling.top_k == 1)
    return 0.0 if greedy else temperature


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
        temperature=scoring_temperature(spec.rollout.sampling),
        micro_batch_tokens=tr.micro_batch_tokens,
        grad_clip=tr.grad_clip,
        pad_id=pad_id,
        pack_row_tokens=tr.pack_row_tokens,
        reward_kl_coef=0.0 if in_loss else al.kl_coef,
        kl_estimator=al.kl_estimator,
        gamma=al.gamma,
        gae_lambda=al.gae_lambda,
        critic=critic,
        mini_batches=tr.mini_batches,
        epochs=tr.epochs,
        seed=tr.seed,
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


@dataclass(frozen=True)
class BeforeUpdate:
    """What the gradient-free pass finds on the (S, T) grid of the whole batch."""

    kl: torch.Tensor  # (S, T) KL(rollout || reference) of each trained token, 0 when the KL is not in the reward
    values: torch.Tensor | None  # (S, T) the critic's values (ppo)
    logp: torch.Tensor | None  # (S, T) the policy's log-probs, when several updates need them


def score_before_update(
    model: torch.nn.Module,
    sequences: Sequence[TrainSequence],
    config: StepConfig,
    ranks: Ranks,
    mask: torch.Tensor,  # (S, T)
    with_logp: bool,
    ref_model: torch.nn.Module | None = None,
) -> BeforeUpdate:
    """The gradient-free pass over the whole batch, before any update; skipped when nothing needs it."""
    kl = torch.zeros_like(mask)
    values = torch.zeros_like(mask) if config.critic is not None else None
    logp = torch.zeros_like(mask) if with_logp else None
    if config.reward_kl_coef <= 0 and values is None and logp is None:
        return BeforeUpdate(kl, values, logp)
    # This rank's micro-batches; None marks an idle one that only joins the collectives.
    plan = rank_plan([len(s.tokens) for s in sequences], config.micro_batch_tokens, config.pack_row_tokens, ranks)
    with torch.no_grad():
        for rows in plan:
            batch = micro_batch(sequences, rows, config.pad_id)
            ids, width = batch.seq_ids, batch.mask.shape[1]
            scored = token_logprobs(model, batch, config.temperature, with_hidden=values is not None)
            if config.reward_kl_coef > 0:
                assert ref_model is not None, "a KL in the reward needs a reference model"
                reference = token_logprobs(ref_model, batch, config.temperature).logp
                if rows is not None:
                    # The policy's own log-probs, computed here as the reference's are: against the engines', their
                    # numerical mismatch with the trainer (other kernels, bf16) read as KL, and the advantages of a
                    # policy still equal to the reference carried it as signal. Only tokens the policy sampled:
                    # others (a tool's reply) would penalise the response for text it did not write.
                    kl[ids, :width] = kl_penalty(scored.logp, reference, config.kl_estimator) * batch.mask
            if rows is not None and values is not None and config.critic is not None:
                assert scored.hidden is not None
                values[ids, :width] = config.critic.values(scored.hidden) * batch.present
            if rows is not None and logp is not None:
                logp[ids, :width] = scored.logp * batch.present
    for grid in (kl, values, logp):
        if grid is not None:
            sum_tensor_over_ranks(grid, ranks)
    return BeforeUpdate(kl, values, logp)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    groups: Sequence[SampleGroup],
    config: StepConfig,
    ref_model: torch.nn.Module | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Trains on `groups` as step `step` of the run (it seeds the order of the mini-batches); returns
    the step's metrics:

    - loss, value_loss: means over the step's updates; grad_norm (before clipping): over the updates taken
      (not finite only when every one was skipped);
    - pg_clipfrac, approx_kl, entropy, tis_weight, ...: means over the sequences of every update;
    - optimizer_updates: the updates the step made (mini_batches x epochs, fewer when the batch holds
      fewer sequences than mini_batches, 0 when it holds none: then `skipped` is 1 and the step reports no
      loss, gradient or token metrics); update_skipped: how many of them a gradient that was not finite skipped;
    - logprob_diff: mean |trainer - rollout| log-prob over trained tokens, in the first epoch (each
      sequence scored once; with several mini-batches the later ones by an already updated policy);
    - lr: the learning rate of the step's first update;
    - tokens, micro_batches, pack_efficiency, tokens_per_second: over every update of the step.
    """
    started = time.perf_counter()
    sequences = sequences_from_groups(groups)
    rewards = [s.reward for g in groups for s in g.samples if s.status in TRAINABLE]  # failed ones have none
    metrics: dict[str, float] = {"samples": float(len(sequences)), "lr": float(scheduler.get_last_lr()[0])}
    if rewards:  # none scored: no mean to report (NaN on /metrics), rather than a 0 that reads as a collapse
        metrics["reward_mean"] = sum(rewards) / len(rewards)
    if not sequences:
        # No sample to train on (every one failed): no update, but the schedule, which counts mini_batches x epochs
        # updates a step, moves on by them, so it still ends at the run's last step. No loss, gradient or
        # tokens to report either: their gauges say so (metrics.py) rather than keep the previous step's.
        for _ in range(config.epochs * config.mini_batches):
            scheduler.step()
        metrics.update({"skipped": 1.0, "optimizer_updates": 0.0, "update_skipped": 0.0})
        return metrics
    ranks = current_ranks()
    mask, present = response_grid(sequences)  # (S, T)
    # What compares the policy before the updates with something: the rollout (TIS, the band), or each update (GSPO's
    # sequence ratio, whose old policy is the trainer's).
    off_policy = (
        config.loss.tis_cap > 0
        or config.loss.ratio_mask_low > 0
        or config.loss.ratio_mask_high > 0
        or config.loss.sequence_ratio
    )
    # In the updates' mode from the start: the pre-update log-probs and the values come from the model the updates
    # train (its dropout is off, see disable_dropout; a module may still act differently in training mode).
    model.train()
    # With one update the policy's current log-probs are its pre-update ones: no pass needed to record them.
    before = score_before_update(
        model, sequences, config, ranks, mask, off_policy and config.updates(len(sequences)) > 1, ref_model
    )
    estimate = config.algorithm.advantages(
        AdvantageInputs(
            rewards=torch.tensor([s.reward for s in sequences], dtype=torch.float32),
            groups=torch.tensor([s.group for s in sequences]),
            mask=mask,
            present=present,
            kl=before.kl,
            kl_coef=config.reward_kl_coef,
            values=before.values,
            gamma=config.gamma,
            gae_lambda=config.gae_lambda,
        )
    )
    advantages = estimate.advantages * torch.tensor([s.weight for s in sequences]).unsqueeze(1)  # (S, T)
    targets = BatchTargets(advantages, mask, estimate.returns, before.values, before.logp)

    results: list[UpdateResult] = []
    diff_total = 0.0
    for epoch in range(config.epochs):
        parts = mini_batch_parts([s.group for s in sequences], config.mini_batches, config.seed, step, epoch)
        for part in parts:
            result = update_policy(model, optimizer, scheduler, sequences, part, targets, config, ranks, ref_model)
            results.append(result)
            if epoch == 0:
                diff_total += result.logprob_diff_sum
    # The schedule counts mini_batches x epochs updates a step (optim.py); a step with fewer sequences than
    # mini_batches took fewer, and the schedule moves on by the rest, so it still ends at the run's last step.
    for _ in range(config.epochs * config.mini_batches - len(results)):
        scheduler.step()
    elapsed = time.perf_counter() - started
    updates = len(results)
    taken = [r.grad_norm for r in results if not r.skipped]
    stat_totals: dict[str, float] = defaultdict(float)
    for result in results:
        for name, value in result.stats.items():
            stat_totals[name] += value
    trained_tokens = float(mask.sum())
    tokens_total = sum(r.tokens for r in results)
    # Per-sample means, averaged over the sequences with a trained token: one without (truncated under "mask")
    # adds 0 to every statistic, and counted it diluted them all (tis_weight read 0.5 for 1.0).
    trained_sequences = max(1, int((mask.sum(dim=1) > 0).sum()))
    metrics.update({name: total / (trained_sequences * config.epochs) for name, total in stat_totals.items()})
    if config.critic is not None:
        metrics["value_loss"] = sum(r.value_loss for r in results) / updates
    metrics.update(
        {
            "loss": sum(r.loss for r in results) / updates,
            # Over the updates taken: a skipped update's norm is not finite (and is why it was skipped).
            "grad_norm": sum(taken) / len(taken) if taken else results[0].grad_norm,
            "optimizer_updates": float(updates),
            "update_skipped": float(sum(r.skipped for r in results)),
            "logprob_diff": diff_total / max(1.0, trained_tokens),
            "advantage_abs_mean": float((advantages.abs() * mask).sum()) / max(1.0, trained_tokens),
            "tokens": float(tokens_total),
            "pack_efficiency": tokens_total / max(1, sum(r.slots for r in results)),
            "micro_batches": float(sum(r.micro_batches for r in results)),
            "step_seconds": elapsed,
            "tokens_per_second": tokens_total / elapsed if elapsed > 0 else 0.0,
        }
    )
    return metrics
