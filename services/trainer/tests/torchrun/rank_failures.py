"""Run under torchrun by test_rank_failures.py: how the rank protocol meets a rank that hangs, a step only
rank 0 takes failing inside an op, and a stop while an op still runs. Each rank writes what it saw to
OUT_DIR/rank<N>.json.

    torchrun --standalone --nproc_per_node=2 rank_failures.py SCENARIO OUT_DIR TIMEOUT_S

Scenarios:
- hang_in_op: rank 1 stops itself (SIGSTOP, as a hung NCCL call or a frozen node) inside an op;
- hang_idle: rank 1 stops itself just after an op, while rank 0 has nothing to announce;
- rank_0_only: checkpoints whose rank-0-only steps fail (the checkpoint root is a file; the rename fails);
- stop_in_op: rank 0 stops the ranks while an op (a long one, on every rank) still runs.

A rank that stopped itself is left to the test, which continues or kills it by pid: its pid is in
OUT_DIR/pid<N>. After a scenario that leaves the ranks out of step a rank ends with os._exit, as `serve` does.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

import rlfleet_trainer.checkpoint as checkpoint
from rlfleet_trainer.checkpoint import CheckpointMeta, TrainingState, checkpoint_steps, save_checkpoint
from rlfleet_trainer.rank_group import RankGroup


def record(log: list[str], item: str) -> str:
    log.append(item)
    return item


def freeze_on_1(log: list[str], after_s: float) -> None:
    """Rank 1 stops itself: at once (inside the op) or `after_s` later (once back waiting for a command)."""
    if dist.get_rank() != 1:
        return
    if after_s <= 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGSTOP)).start()


def save(log: list[str], root: str, step: int, failing_rename: bool) -> str:
    """A checkpoint of a small model at `root`; with `failing_rename` rank 0 cannot rename it into place."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0))
    replace = checkpoint.replace_directory

    def failing(new: Path, dest: Path) -> None:
        raise OSError(errno.EIO, "Input/output error", str(dest))

    if failing_rename and dist.get_rank() == 0:
        checkpoint.replace_directory = failing
    try:
        return str(save_checkpoint(Path(root), parts, CheckpointMeta(step=step)))
    except Exception as exc:
        log.append(f"save raised {type(exc).__name__}: {exc}")
        raise
    finally:
        checkpoint.replace_directory = replace


def long_op(log: list[str], seconds: float) -> None:
    time.sleep(seconds)
    log.append("long op done")


def timed(seen: dict[str, Any], key: str, group: RankGroup, op: str, *args: Any) -> None:
    """Calls `op`, noting in `seen[key]` how it ended, after how long, and its error's gRPC code."""
    started = time.monotonic()
    try:
        outcome: dict[str, Any] = {"result": group.call(op, *args)}
    except Exception as exc:  # noqa: BLE001 - what it raised is the point
        outcome = {"error": type(exc).__name__, "message": str(exc), "grpc_code": getattr(exc, "grpc_code", None)}
    outcome["seconds"] = time.monotonic() - started
    seen[key] = outcome


def wait_broken(group: RankGroup, bound_s: float) -> float | None:
    """Seconds until the group says it is broken, None if it did not within `bound_s`."""
    started = time.monotonic()
    while time.monotonic() - started < bound_s:
        if getattr(group, "broken", None):
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def leader(scenario: str, group: RankGroup, out_dir: Path, timeout_s: float, seen: dict[str, Any]) -> bool:
    """Rank 0's part; whether the ranks can still meet at the end."""
    told: list[str] = []
    if hasattr(group, "on_broken"):
        group.on_broken(told.append)
    timed(seen, "first", group, "record", "a")
    if scenario == "hang_in_op":
        timed(seen, "hung", group, "freeze_on_1", 0.0)
        timed(seen, "after", group, "record", "b")
    elif scenario == "hang_idle":
        timed(seen, "freeze", group, "freeze_on_1", 0.5)
        seen["broken_after_s"] = wait_broken(group, 3 * timeout_s)
        timed(seen, "after", group, "record", "b")
    elif scenario == "rank_0_only":
        root_file = out_dir / "checkpoints-file"
        root_file.write_text("not a directory")
        timed(seen, "root_is_a_file", group, "save", str(root_file), 1, False)
        timed(seen, "rename_fails", group, "save", str(out_dir / "checkpoints"), 2, True)
        timed(seen, "after", group, "record", "b")
        timed(seen, "good_save", group, "save", str(out_dir / "checkpoints"), 3, False)
        seen["steps"] = checkpoint_steps(out_dir / "checkpoints")
    elif scenario == "stop_in_op":
        runner = threading.Thread(target=timed, args=(seen, "long", group, "long_op", 1.5 * timeout_s), daemon=True)
        runner.start()
        time.sleep(1.0)
        started = time.monotonic()
        try:
            seen["stop_released"] = group.stop(1.0)  # type: ignore[call-arg]
        except TypeError as exc:  # no bound to give
            seen["stop_released"] = f"TypeError: {exc}"
            group.stop()
        seen["stop_seconds"] = time.monotonic() - started
    seen["broken"] = getattr(group, "broken", None)
    seen["told"] = told
    if scenario == "stop_in_op":
        return False
    started = time.monotonic()
    try:
        released = group.stop()
    except Exception as exc:  # noqa: BLE001 - a stop that fails leaves the ranks out of step
        seen["final_stop_error"] = f"{type(exc).__name__}: {exc}"
        released = False
    seen["final_stop_seconds"] = time.monotonic() - started
    return released is not False


def main(scenario: str, out_dir: str, timeout_s: float) -> None:
    out = Path(out_dir)
    log: list[str] = []
    ops = {"record": record, "freeze_on_1": freeze_on_1, "save": save, "long_op": long_op}
    group = RankGroup(ops, log, timeout_s, CollectorRegistry())
    rank = group.rank
    (out / f"pid{rank}").write_text(str(os.getpid()))
    seen: dict[str, Any] = {}
    together = True
    if rank == 0:
        together = leader(scenario, group, out, timeout_s, seen)
    else:
        try:
            group.follow()
        except Exception as exc:  # noqa: BLE001 - what ended the follower is the point
            seen["follow_raised"] = f"{type(exc).__name__}: {exc}"
            together = False
    (out / f"rank{rank}.json").write_text(json.dumps({"log": log, "seen": seen}))
    if together and group.close() is not False:
        return
    sys.stdout.flush()
    os._exit(0)  # out of step: the process group cannot be torn down


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
