"""One step's global batch split over data-parallel ranks, and its results summed back.

Every rank holds the whole global batch (it is small: token ids and rewards), so every rank can
compute the advantages of the whole batch and the same deterministic split: sequences go longest
first to the rank with the fewest tokens so far. A rank then trains only on its share.

FSDP runs collectives inside every forward and backward pass, so all ranks must run the same
number of micro-batches. A rank with fewer runs idle micro-batches: one padding token scored with
loss mask 0, which moves no gradient and no statistic but joins every collective. Without a
process group (or with one rank) nothing here communicates and a rank's share is the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlfleet_trainer.batch import PackedBatch, TrainSequence, pack, plan_micro_batches

MicroBatchPlan = list[list[int]] | None
"""Rows of sequence indices of one micro-batch, or None for an idle micro-batch."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1


def current_ranks() -> Ranks:
    """This process's place in the default process group; rank 0 of 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def split_across_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of `lengths` dealt to `world` ranks, balancing tokens: longest first, each to the rank
    with the fewest tokens so far (the lowest rank on ties). Each share is in ascending index order,
    so one rank's share is the batch in its original order."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return [sorted(share) for share in shares]


def rank_plan(lengths: Sequence[int], token_budget: int, row_tokens: int, ranks: Ranks) -> list[MicroBatchPlan]:
    """This rank's micro-batches (rows of indices into `lengths`), padded with idle ones (None) to
    the largest number of micro-batches any rank has."""
    plans = []
    for share in split_across_ranks(lengths, ranks.world):
        local = plan_micro_batches([lengths[i] for i in share], token_budget, row_tokens)
        plans.append([[[share[j] for j in row] for row in micro] for micro in local])
    longest = max(len(plan) for plan in plans)
    mine: list[MicroBatchPlan] = list(plans[ranks.rank])
    return mine + [None] * (longest - len(mine))


def idle_sequence(pad_id: int) -> TrainSequence:
    """A padding token predicting a padding token, trained on by no one (mask 0)."""
    return TrainSequence(tokens=(pad_id, pad_id), prompt_len=1, old_logp=(0.0,), mask=(0,))


def micro_batch(sequences: Sequence[TrainSequence], rows: MicroBatchPlan, pad_id: int) -> PackedBatch:
    """The packed batch of `rows`; an idle micro-batch points at row 0 of the step's grids, which its
    mask of 0 leaves untouched."""
    if rows is None:
        return pack([idle_sequence(pad_id)], [[0]], pad_id)
    return pack(sequences, rows, pad_id)


def sum_over_ranks(values: Sequence[float], ranks: Ranks) -> list[float]:
    """Elementwise sum of `values` over all ranks (float64, so counts stay exact)."""
    if ranks.world == 1:
        return list(values)
    total = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist()


def sum_tensor_over_ranks(tensor: torch.Tensor, ranks: Ranks) -> None:
    """In place: each rank fills the rows of its share and leaves zeros elsewhere, so the sum is
    the whole batch's grid on every rank."""
    if ranks.world > 1:
        dist.all_reduce(tensor)


def sum_gradients_over_ranks(module: torch.nn.Module, ranks: Ranks) -> None:
    """For a module every rank holds whole (PPO's value head): summed, its gradients are those of
    the whole batch, as FSDP's reduction gives the sharded policy."""
    if ranks.world == 1:
        return
    for param in module.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
