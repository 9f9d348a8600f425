"""From SampleGroups to packed micro-batches: sequences concatenated into rows, no padding waste.

A packed row holds several sequences back to back. Each attends only to itself (a block-diagonal
causal 4D attention mask) and its position ids restart at 0, so the model computes for every
sequence exactly what it would compute for that sequence alone. Rows of one micro-batch are
padded to the longest row only (first-fit-decreasing keeps rows nearly full).

Positions follow next-token prediction: the logits at position p predict token p + 1, so response
token j of a sequence whose prompt has P tokens is scored at position P - 1 + j of its segment.
Per-token quantities (rollout log-probs, loss masks, advantages, values) live on a small
(B, T) response grid, B sequences by T = the longest response; `PackedBatch.index` maps every
grid cell to the flat position of the packed rows that predicts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlfleet.v1.samples_pb2 import SampleGroup, SampleStatus

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
    reward: float = 0.0
    group: int = 0
    """Index of the SampleGroup (prompt) the sequence answers, within the step."""
    weight: float = 1.0
    """Loss weight of its group (scales the advantages)."""

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def sequences_from_groups(groups: Sequence[SampleGroup]) -> list[TrainSequence]:
    """Trainable samples as sequences, in stream order.

    Samples that failed or were aborted are left out, and so is their reward: advantages compare
    only responses the trainer will see. A group's `weight` (0 means 1) travels with its samples.
    """
    out: list[TrainSequence] = []
    for index, group in enumerate(groups):
        weight = group.weight or 1.0
        for sample in group.samples:
            if sample.status not in TRAINABLE or len(sample.response_token_ids) == 0:
                continue
            out.append(
                TrainSequence(
                    tokens=(*sample.prompt_token_ids, *sample.response_token_ids),
                    prompt_len=len(sample.prompt_token_ids),
                    old_logp=tuple(sample.rollout_logprobs),
                    mask=tuple(sample.loss_mask),
                    reward=sample.reward,
                    group=index,
                    weight=weight,
                )
            )
    return out


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into rows of at most `row_tokens` tokens
    (a sequence longer than that gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row_tokens - lengths[i])
    return rows


def plan_micro_batches(lengths: Sequence[int], token_budget: int, row_tokens: int = 0) -> list[list[list[int]]]:
    """Packs sequences into rows (of `row_tokens`, 0: the longest sequence) and rows into
    micro-batches whose padded size, rows x longest row, stays within `token_budget` (a longer
    single row goes alone). Returns micro-batches of rows of sequence indices."""
    if not lengths:
        return []
    rows = pack_rows(lengths, row_tokens or max(lengths))
    row_len = [sum(lengths[i] for i in row) for row in rows]
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    longest = 0
    for r in sorted(range(len(rows)), key=lambda r: -row_len[r]):
        if current and (len(current) + 1) * max(longest, row_len[r]) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(rows[r])
        longest = max(longest, row_len[r])
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # (R, L) sequences concatenated per row, padded at the row's end
    position_ids: torch.Tensor  # (R, L) restart at 0 for every sequence
    attention_mask: torch.Tensor  # (R, 1, L, L) additive: 0 where query may attend to key, -inf-like elsewhere
    targets: torch.Tensor  # (R, L) the token each position predicts (0 where it predicts none)
    index: torch.Tensor  # (B, T) flat position in (R * L) predicting response token t of sequence b
    seq_ids: torch.Tensor  # (B,) index of each sequence in the caller's list
    old_logp: torch.Tensor  # (B, T) rollout log-probs, 0 off-response
    mask: torch.Tensor  # (B, T) 1.0 where a trained response token sits
    present: torch.Tensor  # (B, T) 1.0 for every response token, trained or not
    tokens: int
    """Real (non-padding) tokens in the rows."""

    @property
    def size(self) -> int:
        return int(self.index.shape[0])


def block_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """segments: (R, L) a segment id per position -> (R, 1, L, L) additive attention mask where a
    query attends to keys of its own segment at or before it (padding is a segment of its own)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L)
    same = segments.unsqueeze(2) == segments.unsqueeze(1)  # (R, L, L)
    allowed = (same & causal).unsqueeze(1)  # (R, 1, L, L)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def pack(
    sequences: Sequence[TrainSequence], rows: Sequence[Sequence[int]], pad_id: int, dtype: torch.dtype = torch.float32
) -> PackedBatch:
    """Lays out `sequences[i]` for the indices in `rows`, one packed row per entry."""
    assert rows and all(rows), "pack needs at least one non-empty row"
    order = [i for row in rows for i in row]
    length = max(sum(len(sequences[i].tokens) for i in row) for row in rows)
    width = max(sequences[i].response_len for i in order)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    segments = torch.full((len(rows), length), -1, dtype=torch.long)
    targets = torch.zeros((len(rows), length), dtype=torch.long)
    index = torch.zeros((len(order), width), dtype=torch.long)
    old_logp = torch.zeros((len(order), width), dtype=torch.float32)
    mask = torch.zeros((len(order), width), dtype=torch.float32)
    present = torch.zeros((len(order), width), dtype=torch.float32)
    b = 0
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            seq = sequences[i]
            n, response = len(seq.tokens), seq.response_len
            assert seq.prompt_len >= 1, "a sequence needs a prompt token to predict its first response token"
            ids = torch.tensor(seq.tokens, dtype=torch.long)
            input_ids[r, offset : offset + n] = ids
            position_ids[r, offset : offset + n] = torch.arange(n)
            segments[r, offset : offset + n] = b
            targets[r, offset : offset + n - 1] = ids[1:]
            first = r * length + offset + seq.prompt_len - 1  # flat position predicting the first response token
            index[b, :response] = torch.arange(first, first + response)
            old_logp[b, :response] = torch.tensor(seq.old_logp, dtype=torch.float32)
            mask[b, :response] = torch.tensor(seq.mask, dtype=torch.float32)
            present[b, :response] = 1.0
            offset += n
            b += 1
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=block_causal_mask(segments, dtype),
        targets=targets,
        index=index,
        seq_ids=torch.tensor(order, dtype=torch.long),
        old_logp=old_logp,
        mask=mask,
        present=present,
        tokens=sum(len(sequences[i].tokens) for i in order),
    )
