"""Run under torchrun by test_checkpoint_ranks.py: one training step and a checkpoint, or a resume
from one saved by another number of ranks; rank 0 writes what the other side compares.

    torchrun --standalone --nproc_per_node=N checkpoint_ranks.py save MODEL_DIR ROOT OUT_FILE
    torchrun --standalone --nproc_per_node=N checkpoint_ranks.py load MODEL_DIR ROOT OUT_FILE
    torchrun --standalone --nproc_per_node=N checkpoint_ranks.py refuse MODEL_DIR ROOT OUT_FILE

`save` trains one step, checkpoints it, and writes the full weights after a second step; `load`
restores the checkpoint, takes that second step on the same batch and writes the full weights, so
equal outputs mean the model, the optimizer's moments and the schedule all came back. `refuse` loads
a damaged checkpoint: each rank writes what it raised to OUT_FILE.rank<N>.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlfleet_trainer.checkpoint import (
    CheckpointFailed,
    CheckpointMeta,
    TrainingState,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from rlfleet_trainer.optim import LrSchedule, make_optimizer
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.sharding import full_state_dict, shard_model


def step(parts: TrainingState, seed: int) -> None:
    """One step on a batch every rank draws alike, each rank on its share, weighted by the share's part
    of the batch (the trainer's FSDP sums gradients over ranks), so every world size takes the same step."""
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(seed))  # (B, T)
    rank, world = dist.get_rank(), dist.get_world_size()
    logits = parts.model(input_ids=ids[rank::world]).logits  # (B / world, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[rank::world, 1:].flatten())
    (loss * len(ids[rank::world]) / len(ids)).backward()
    parts.optimizer.step()
    parts.scheduler.step()
    parts.optimizer.zero_grad()


def main(mode: str, model_dir: str, root: str, out: str) -> None:
    dist.init_process_group("gloo")
    model = load_policy(model_dir)
    if dist.get_world_size() > 1:
        shard_model(model)
    optimizer, scheduler = make_optimizer(model, 1e-2, 0.01, LrSchedule(warmup_steps=2, kind="cosine", total_steps=9))
    parts = TrainingState(model, optimizer, scheduler)
    if mode == "refuse":
        try:
            load_checkpoint(checkpoint_dir(Path(root), 1), parts)
        except CheckpointFailed as exc:
            Path(f"{out}.rank{dist.get_rank()}").write_text(f"damaged={exc.damaged} {exc}")
        dist.barrier()
        dist.destroy_process_group()
        return
    if mode == "save":
        step(parts, seed=1)
        save_checkpoint(Path(root), parts, CheckpointMeta(step=1, weight_version=1))
    else:
        meta = load_checkpoint(checkpoint_dir(Path(root), 1), parts)
        assert meta.step == 1, meta
    step(parts, seed=2)
    weights = full_state_dict(model)
    if dist.get_rank() == 0:
        torch.save(weights, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # Every rank is past the barrier and out of the group, its work written. Python's own teardown could
    # still abort the process now and then ("terminate called without an active exception" from a thread
    # torch leaves behind), failing a job that succeeded: end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
