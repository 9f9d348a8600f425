"""Rank script: the small model (tied embedding and lm_head) sharded over the ranks with FSDP2, its full state
gathered as the trainer publishes it; rank 0 writes which names a broadcast of that state would carry."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rlfleet_trainer.sharding import full_state_dict, shard_model
from rlfleet_trainer.weight_broadcast import unique_tensors
from rlfleet_trainer.weights import without_tied_copies


def main(model_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    try:
        model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir))
        state = full_state_dict(model)
        if dist.get_rank() == 0:
            sent = list(unique_tensors(without_tied_copies(state, model)))
            Path(out).write_text(json.dumps({"gathered": list(state), "sent": sent}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Every rank is past the barrier and out of the group, its work written. Python's own teardown could
    # still abort the process now and then ("terminate called without an active exception" from a thread
    # torch leaves behind), failing a job that succeeded: end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
