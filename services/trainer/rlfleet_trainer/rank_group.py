"""The trainer's ranks in lockstep: rank 0 serves and decides, the other ranks follow.

Everything that runs collectives (loading a run's sharded model, a training step, gathering the
full weights, checkpoints) must run on every rank, in the same order. Rank 0 broadcasts a small
command (an op name and its arguments) and runs the op itself; the followers receive the command
and run the same op on their own state. After each op the ranks exchange whether it failed, so a
follower's failure is raised on rank 0 instead of surfacing as a hang in the next collective.

Commands travel on a gloo group of their own, so they never wait behind NCCL work on a GPU.
Every wait is bounded by the process group's timeout; while rank 0 has nothing to announce it
sends a no-op every quarter of that timeout, so idle followers do not time out. Without a process
group (no torchrun) `call` is a plain local call.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlfleet.errors import Internal
from rlfleet_trainer.data_parallel import Ranks

logger = logging.getLogger(__name__)

Op = Callable[..., Any]
"""op(state, *args): runs on every rank with that rank's state; rank 0's result is returned."""

STOP = "stop"
NOOP = "noop"


class RankOpFailed(Internal):
    """An op failed on a rank other than 0; the ranks may no longer agree on the run's state."""


@dataclass(frozen=True)
class RankCommand:
    op: str
    args: tuple[Any, ...] = ()


def init_process_group(timeout_s: float) -> None:
    """Joins the torchrun job (MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK from the environment):
    gloo on CPU; NCCL for GPU tensors with gloo for CPU ones when CUDA is available."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


class RankGroup:
    def __init__(
        self,
        ops: Mapping[str, Op],
        state: object,
        timeout_s: float = 600.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """Under torchrun (WORLD_SIZE set) joins the process group; otherwise works alone.

        ops: the collective operations by name, each a function of (state, *args).
        state: this rank's own state object, passed to every op.
        timeout_s: bound on every collective wait, including a follower's wait for a command.
        """
        reserved = {STOP, NOOP} & set(ops)
        if reserved:
            raise ValueError(f"op names {sorted(reserved)} are reserved by the rank protocol")
        self.ops = dict(ops)
        self.state = state
        self.distributed = "WORLD_SIZE" in os.environ
        self._commands: dist.ProcessGroup | None = None
        if self.distributed:
            init_process_group(timeout_s)
            self.ranks = Ranks(dist.get_rank(), dist.get_world_size())
            if self.ranks.world > 1:
                self._commands = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        else:
            self.ranks = Ranks()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._last_command = time.monotonic()
        self._heartbeat_s = timeout_s / 4
        self._heartbeat: threading.Thread | None = None
        registry = registry or CollectorRegistry()
        self._op_seconds = Histogram(
            "rlfleet_trainer_rank_op_seconds",
            "time of one collective op run on every trainer rank",
            ["op"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self._op_failures = Counter(
            "rlfleet_trainer_rank_op_failures_total",
            "collective ops that failed on some rank",
            ["op"],
            registry=registry,
        )
        Gauge("rlfleet_trainer_ranks", "ranks of the trainer's process group", registry=registry).set(self.ranks.world)
        if self.ranks.rank == 0 and self._commands is not None:
            self._heartbeat = threading.Thread(target=self._beat, name="rank-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def rank(self) -> int:
        return self.ranks.rank

    def call(self, op: str, *args: Any) -> Any:
        """Runs `op` on every rank (rank 0 only announces) and returns rank 0's result. Raises what
        rank 0's op raised, or RankOpFailed when only another rank's failed."""
        if self.ranks.rank != 0:
            raise RuntimeError("only rank 0 announces ops; the other ranks run follow()")
        if op not in self.ops and op != NOOP:
            raise ValueError(f"unknown rank op {op!r}; registered: {sorted(self.ops)}")
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError(f"rank op {op!r} after the ranks were stopped")
            command = RankCommand(op, args)
            if self._commands is not None:
                dist.broadcast_object_list([command], src=0, group=self._commands)
            return self._run(command)

    def follow(self) -> None:
        """A follower's life: runs the ops rank 0 announces until it announces stop."""
        if self.ranks.rank == 0:
            raise RuntimeError("rank 0 announces ops with call(); it does not follow")
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self._commands)
            command: RankCommand = box[0]
            if command.op == STOP:
                logger.info("rank %d: stop received", self.ranks.rank)
                return
            try:
                self._run(command)
            except Exception:  # noqa: BLE001 - reported to rank 0 by _run; the follower stays in lockstep
                logger.exception("rank %d: op %s failed", self.ranks.rank, command.op)

    def stop(self) -> None:
        """Rank 0: ends the followers' loops (after any op in flight). Idempotent."""
        if self.ranks.rank != 0:
            return
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if self._commands is not None:
                dist.broadcast_object_list([RankCommand(STOP)], src=0, group=self._commands)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)

    def close(self) -> None:
        """Leaves the process group once every rank got here (after stop / follow)."""
        if self.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # -- internals --------------------------------------------------------------------------------

    def _run(self, command: RankCommand) -> Any:
        self._last_command = time.monotonic()
        if command.op == NOOP:
            return None
        started = time.perf_counter()
        result, error, failure = None, None, None
        try:
            result = self.ops[command.op](self.state, *command.args)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below
            error, failure = f"{type(exc).__name__}: {exc}", exc
        errors: list[str | None] = [error]
        if self._commands is not None:
            errors = [None] * self.ranks.world
            dist.all_gather_object(errors, error, group=self._commands)
        self._op_seconds.labels(command.op).observe(time.perf_counter() - started)
        self._last_command = time.monotonic()
        if failure is not None:
            self._op_failures.labels(command.op).inc()
            raise failure
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            self._op_failures.labels(command.op).inc()
            detail = "; ".join(f"rank {rank}: {e}" for rank, e in failed)
            raise RankOpFailed(f"op {command.op!r} failed on {detail}")
        return result

    def _beat(self) -> None:
        while not self._stopped.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._last_command < self._heartbeat_s:
                continue
            try:
                self.call(NOOP)
            except Exception:  # noqa: BLE001 - a stopped or broken group ends the heartbeat, not the server
                if not self._stopped.is_set():
                    logger.exception("rank heartbeat failed; followers will time out")
                return
