"""Run under torchrun by test_fsdp_rank_group.py: rank 0 announces ops, the others follow; every
rank writes what it ran, in order, to OUT_DIR/rank<N>.json.

    torchrun --standalone --nproc_per_node=2 rank_protocol.py OUT_DIR TIMEOUT_S IDLE_S

Rank 0 stays idle for IDLE_S (longer than the group's TIMEOUT_S) before its last op, so the
followers only survive the wait if the heartbeat keeps them alive.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint import FileSystemWriter

from rlfleet_trainer.checkpoint import CheckpointFailed, CheckpointMeta, TrainingState, save_checkpoint
from rlfleet_trainer.rank_group import RankGroup, RankOpFailed


def record(log: list[str], item: str) -> tuple[int, str]:
    log.append(item)
    return dist.get_rank(), item


def fail_on(log: list[str], rank: int) -> None:
    """Fails on `rank` only; the other ranks log that they ran it."""
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} was asked to fail")
    log.append(f"fail_on {rank}")


def checkpoint_on_a_full_disk(log: list[str], root: str) -> None:
    """A checkpoint whose write fails on rank 1 (its disk is full): DCP raises on every rank."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0))
    write = FileSystemWriter.write_data

    def full_on_rank_1(self: FileSystemWriter, *args: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, *args)

    FileSystemWriter.write_data = full_on_rank_1  # type: ignore[method-assign,assignment]
    try:
        save_checkpoint(Path(root), parts, CheckpointMeta(step=1))
    finally:
        FileSystemWriter.write_data = write  # type: ignore[method-assign]


def summed(log: list[str], value: float) -> float:
    """A collective inside an op: the sum of `value` over the ranks."""
    total = torch.tensor([value])
    dist.all_reduce(total)
    log.append(f"summed {float(total)}")
    return float(total)


def main(out_dir: str, timeout_s: float, idle_s: float) -> None:
    log: list[str] = []
    registry = CollectorRegistry()
    ops = {"record": record, "fail_on": fail_on, "summed": summed, "checkpoint": checkpoint_on_a_full_disk}
    group = RankGroup(ops, log, timeout_s, registry)
    rank = group.rank
    seen: dict[str, object] = {}
    if rank == 0:
        seen["record"] = group.call("record", "a")
        seen["summed"] = group.call("summed", 1.5)
        try:
            group.call("fail_on", 1)
        except RankOpFailed as exc:
            seen["follower_failure"] = str(exc)
        try:
            group.call("fail_on", 0)
        except ValueError as exc:
            seen["own_failure"] = str(exc)
        try:
            group.call("checkpoint", str(Path(out_dir, "checkpoints")))
        except CheckpointFailed as exc:  # DCP's own exception would end the follower's loop and the job
            seen["checkpoint_failure"] = str(exc)
        time.sleep(idle_s)
        seen["after_idle"] = group.call("record", "b")
        seen["failures_metric"] = registry.get_sample_value("rlfleet_trainer_rank_op_failures_total", {"op": "fail_on"})
        group.stop()
    else:
        group.follow()
    group.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"log": log, "seen": seen}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
