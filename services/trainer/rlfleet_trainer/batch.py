"""From SampleGroups to padded tensors: one sequence per usable sample, micro-batched by tokens.

Positions follow next-token prediction: the logits at position p predict token p + 1, so response
token j of a sequence whose prompt has P tokens is scored at position P - 1 + j of the (B, L - 1)
grid. Rollout log-probabilities, loss masks and advantages are laid out on that same grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlfleet.v1.samples_pb2 import SampleGroup, SampleStatus
from rlfleet_trainer.advantages import group_normalized_advantages

TRAINABLE = (SampleStatus.SAMPLE_STATUS_OK, SampleStatus.SAMPLE_STATUS_TRUNCATED)


@dataclass(frozen=True)
class TrainSequence:
    tokens: tuple[int, ...]
    """Prompt then response token ids."""
    prompt_len: int
    old_logp: tuple[float, ...]
    """Rollout log-probability of each response token."""
    mask: tuple[int, ...]
    """1 where the response token is trained on."""
    advantage: float


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L-1) the token each position predicts
    old_logp: torch.Tensor  # (B, L-1) rollout log-probs on the target grid, 0 off-response
    mask: torch.Tensor  # (B, L-1) 1.0 where a trained response token is predicted
    advantages: torch.Tensor  # (B,)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def sequences_from_groups(groups: Sequence[SampleGroup], scale_by_std: bool = True) -> list[TrainSequence]:
    """Trainable samples as sequences, with GRPO advantages computed within each group.

    Samples that failed or were aborted are left out, and so is their reward: the advantage
    compares only responses the trainer will see. A group's `weight` (0 means 1) scales its advantages.
    """
    out: list[TrainSequence] = []
    for group in groups:
        usable = [s for s in group.samples if s.status in TRAINABLE and len(s.response_token_ids) > 0]
        if not usable:
            continue
        rewards = torch.tensor([[s.reward for s in usable]], dtype=torch.float64)  # (1, n)
        advantages = group_normalized_advantages(rewards, scale_by_std=scale_by_std)[0]
        weight = group.weight or 1.0
        for sample, advantage in zip(usable, advantages.tolist(), strict=True):
            out.append(
                TrainSequence(
                    tokens=(*sample.prompt_token_ids, *sample.response_token_ids),
                    prompt_len=len(sample.prompt_token_ids),
                    old_logp=tuple(sample.rollout_logprobs),
                    mask=tuple(sample.loss_mask),
                    advantage=advantage * weight,
                )
            )
    return out


def micro_batches(sequences: Sequence[TrainSequence], token_budget: int) -> list[list[TrainSequence]]:
    """Splits sequences (sorted by length, to waste little padding) so that each micro-batch's
    padded size, rows x longest row, stays within `token_budget` (a longer single row goes alone)."""
    ordered = sorted(sequences, key=lambda s: len(s.tokens))
    batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for seq in ordered:
        if current and (len(current) + 1) * len(seq.tokens) > token_budget:
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches


def collate(sequences: Sequence[TrainSequence], pad_id: int) -> Batch:
    assert sequences, "collate needs at least one sequence"
    length = max(len(s.tokens) for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    old_logp = torch.zeros((rows, length - 1), dtype=torch.float32)
    mask = torch.zeros((rows, length - 1), dtype=torch.float32)
    for i, seq in enumerate(sequences):
        n = len(seq.tokens)
        input_ids[i, :n] = torch.tensor(seq.tokens)
        attention_mask[i, :n] = 1
        start = seq.prompt_len - 1  # position predicting the first response token
        response = n - seq.prompt_len
        old_logp[i, start : start + response] = torch.tensor(seq.old_logp, dtype=torch.float32)
        mask[i, start : start + response] = torch.tensor(seq.mask, dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:],
        old_logp=old_logp,
        mask=mask,
        advantages=torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
    )
