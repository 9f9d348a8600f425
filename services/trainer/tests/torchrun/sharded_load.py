"""Rank script: the policy and its frozen reference loaded sharded over the ranks, as a run loads them, where only
rank 0 is given a directory with the weights (the others get one holding config.json alone, so reading the
weights there fails); then a model whose weights rank 0 cannot read. Each rank writes what it holds.

    torchrun --standalone --nproc_per_node=2 sharded_load.py MODEL_DIR CONFIG_ONLY_DIR BROKEN_DIR OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from rlfleet_trainer.rank_ops import ShardingOptions, load_model
from rlfleet_trainer.sharding import full_state_dict


def held(model: PreTrainedModel) -> dict[str, Any]:
    """What this rank holds of `model`; the full state is gathered (a collective), rank 0's is kept."""
    return {
        "buffers": {name: buffer.clone() for name, buffer in model.named_buffers()},
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_elements": sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor)),
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "requires_grad": {p.requires_grad for p in model.parameters()},
        "training": model.training,
        "use_cache": model.config.use_cache,
        "full_state": full_state_dict(model),
    }


def main(model_dir: str, config_only_dir: str, broken_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        path = model_dir if rank == 0 else config_only_dir
        # The policy with recomputation: its blocks are wrapped, so their modules are renamed before sharding.
        policy = load_model(path, ShardingOptions(activation_checkpointing=True), trainable=True)
        reference = load_model(path, ShardingOptions(), trainable=False)
        result: dict[str, Any] = {"policy": held(policy), "reference": held(reference)}
        try:
            load_model(broken_dir if rank == 0 else config_only_dir, ShardingOptions(), trainable=True)
            result["broken"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test to check
            result["broken"] = f"{type(exc).__name__}: {exc}"
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # Every rank is past the barrier and out of the group, its work written. Python's own teardown could
    # still abort the process now and then ("terminate called without an active exception" from a thread
    # torch leaves behind), failing a job that succeeded: end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
