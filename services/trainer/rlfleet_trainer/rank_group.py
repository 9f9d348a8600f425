"""The trainer's ranks in lockstep: rank 0 serves and decides, the other ranks follow.

Everything that runs collectives (loading a run's sharded model, a training step, gathering the
full weights, checkpoints) must run on every rank, in the same order. Rank 0 broadcasts a small
command (an op name and its arguments) and runs the op itself; the followers receive the command
and run the same op on their own state. After each op the ranks exchange whether it failed, so a
follower's failure is raised on rank 0 instead of surfacing as a hang in the next collective. A
step inside an op that only rank 0 takes (preparing or renaming a directory) hands its outcome to
the other ranks with `on_rank_0`, so its failure is raised on every rank instead of leaving them
waiting for rank 0 in the op's next collective.

Commands travel on a gloo group of their own, so they never wait behind NCCL work on a GPU.
Every wait is bounded by the process group's timeout; while rank 0 has nothing to announce it
sends a no-op every quarter of that timeout, a round trip of every rank, so idle followers do not
time out and a rank that hangs meanwhile is found. Without a process group (no torchrun) `call`
is a plain local call.

A collective that fails or times out (a rank hung, crashed, or out of step) leaves the ranks
broken for good: gloo cannot use a group again after a timeout, and the ranks no longer agree on
where they are. Every later call then fails at once with `RanksBroken` (Unavailable), naming the
cause, and whoever listens (`on_broken`: `serve` on rank 0, which ends the process so that torchrun
and Kubernetes restart the job) is told once.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlfleet.errors import Internal, Unavailable
from rlfleet_trainer.data_parallel import Ranks

logger = logging.getLogger(__name__)

Op = Callable[..., Any]
"""op(state, *args): runs on every rank with that rank's state; rank 0's result is returned."""

STOP = "stop"
NOOP = "noop"

T = TypeVar("T")

# gloo reports a peer that timed out or went away as a plain RuntimeError (NCCL and the c10d store as
# torch.distributed.DistError); these are the words of its transport's messages.
_GLOO_FAILURE = re.compile(r"gloo|pair closure|Connection closed by peer|Connection reset by peer|Timed out waiting")


class RankOpFailed(Internal):
    """An op failed on a rank other than 0; the ranks may no longer agree on the run's state."""


class RanksBroken(Unavailable):
    """A collective between the ranks failed or timed out: they are out of step, and their process
    group cannot be used again. Only a restart of the job (torchrun, Kubernetes) mends it."""


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


def collective_failure(exc: BaseException) -> bool:
    """Whether `exc` (or an error it was raised from or holds as a cause) is a collective that failed
    between the ranks, rather than the op's own error on healthy ranks."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, dist.DistError) or (
            type(error) is RuntimeError and _GLOO_FAILURE.search(str(error)) is not None
        ):
            return True
        pending += [e for e in (error.__cause__, error.__context__) if e is not None]
        pending += [e for e in getattr(error, "causes", ()) if isinstance(e, BaseException)]
    return False


def on_rank_0(step: Callable[[], object]) -> None:
    """Inside an op: runs `step` on rank 0 only and hands its outcome to every rank before any goes
    on, so its failure is raised on every rank (rank 0 its own error, the others a copy of it) and
    the op fails at once with its real cause. Without that, rank 0 would leave the op while the others
    waited for it in the op's next collective, until the collective timeout. It also stands for a
    barrier after the step: no rank goes on before rank 0 has taken it."""
    rank_0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    on_every_rank(lambda: step() if rank_0 else None)


def on_every_rank(step: Callable[[], T]) -> list[T]:
    """Inside an op: runs `step` on every rank and hands every rank the results of all, in rank order. A
    rank's failure is raised on every rank (that rank its own error, the others a copy of it), so none waits
    in the op's next collective for a rank that left the op."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [step()]
    result, error = None, None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below, then raises it
        error = exc
    boxes: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(boxes, (result, _portable(error)))
    except Exception as exc:  # noqa: BLE001 - the ranks are out of step; the step's own error is kept as its cause
        if error is not None:
            raise exc from error
        raise
    if error is not None:
        raise error
    for rank, (_, rank_error) in enumerate(boxes):
        if rank_error is not None:
            rank_error.add_note(f"raised by rank {rank}'s part of the op")
            raise rank_error
    return [rank_result for rank_result, _ in boxes]


def _portable(error: Exception | None) -> Exception | None:
    """`error` as the other ranks can receive it: itself when it pickles, else its type and message."""
    if error is None:
        return None
    try:
        copy: Exception = pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - some errors do not survive pickling; their words do
        return RuntimeError(f"{type(error).__name__}: {error}")
    return copy


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
        self._released = False
        """Rank 0 told the followers to stop: every rank can meet at `close`."""
        self._broken: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._state_lock = threading.Lock()
        self._last_command = time.monotonic()
        self._heartbeat_s = timeout_s / 4
        self._heartbeat: threading.Thread | None = None
        registry = registry or CollectorRegistry()
        self._op_seconds = Histogram(
            "rlfleet_trainer_rank_op_seconds",
            "time of one collective op run on every trainer rank",
            ["op"],
            # as rlfleet_trainer_step_seconds: a train_step op is a whole step
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 3600),
            registry=registry,
        )
        self._op_failures = Counter(
            "rlfleet_trainer_rank_op_failures_total",
            "collective ops that failed on some rank",
            ["op"],
            registry=registry,
        )
        for name in self.ops:  # at 0 from the start: a first failure shows in rate() and increase()
            self._op_failures.labels(op=name)
        Gauge("rlfleet_trainer_ranks", "ranks of the trainer's process group", registry=registry).set(self.ranks.world)
        if self.ranks.rank == 0 and self._commands is not None:
            self._heartbeat = threading.Thread(target=self._beat, name="rank-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def broken(self) -> str | None:
        """Why the ranks are out of step for good (a sentence naming the op, the rank and the error), or
        None while they work."""
        return self._broken

    def on_broken(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(why)` once, from the thread that finds the ranks broken (at once if they are)."""
        with self._state_lock:
            why = self._broken
            if why is None:
                self._listeners.append(listener)
                return
        listener(why)

    def call(self, op: str, *args: Any) -> Any:
        """Runs `op` on every rank (rank 0 only announces) and returns rank 0's result. Raises what
        rank 0's op raised, RankOpFailed when only another rank's failed, or RanksBroken when the ranks
        are out of step (now or since an earlier call)."""
        if self.ranks.rank != 0:
            raise RuntimeError("only rank 0 announces ops; the other ranks run follow()")
        if op not in self.ops and op != NOOP:
            raise ValueError(f"unknown rank op {op!r}; registered: {sorted(self.ops)}")
        self._raise_if_broken()
        with self._lock:
            self._raise_if_broken()
            if self._stopped.is_set():
                raise RuntimeError(f"rank op {op!r} after the ranks were stopped")
            command = RankCommand(op, args)
            if self._commands is not None:
                try:
                    dist.broadcast_object_list([command], src=0, group=self._commands)
                except Exception as exc:  # noqa: BLE001 - any failure of the command group breaks the ranks
                    what = "the heartbeat" if op == NOOP else f"op {op!r}"
                    raise self._break(f"announcing {what} to the other ranks failed", exc) from exc
            return self._run(command)

    def follow(self) -> None:
        """A follower's life: runs the ops rank 0 announces until it announces stop. Raises RanksBroken
        when the ranks fall out of step (no command from rank 0 within the timeout, a collective that
        failed): the process should end, so that the job restarts."""
        if self.ranks.rank == 0:
            raise RuntimeError("rank 0 announces ops with call(); it does not follow")
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=self._commands)
            except Exception as exc:  # noqa: BLE001 - any failure of the command group breaks the ranks
                raise self._break("waiting for rank 0's next command failed", exc) from exc
            command: RankCommand = box[0]
            if command.op == STOP:
                logger.info("rank %d: stop received", self.ranks.rank)
                return
            try:
                self._run(command)
            except RanksBroken:
                raise
            except Exception:  # noqa: BLE001 - reported to rank 0 by _run; the follower stays in lockstep
                logger.exception("rank %d: op %s failed", self.ranks.rank, command.op)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Rank 0: ends the followers' loops after the op in flight, waiting for it up to `timeout_s`.
        Whether the followers were released (they then meet rank 0 in `close`); not when the ranks are
        broken or the op in flight outlasted `timeout_s` (it is abandoned: the process should end without
        `close`). No op runs after it. Idempotent."""
        if self.ranks.rank != 0:
            return True
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            self._stopped.set()
            logger.warning("an op still runs on the ranks after %.1fs: the followers are not released", timeout_s)
            return False
        try:
            if not self._stopped.is_set():
                self._stopped.set()
                self._released = self._release_followers()
        finally:
            self._lock.release()
        if self._released and self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        return self._released

    def close(self) -> bool:
        """Leaves the process group once every rank got here (after stop / follow). Whether it did: not
        when the ranks are broken or rank 0 did not release the followers, as the ranks cannot meet then
        (a gloo group that timed out cannot even be torn down); the process should then just end."""
        if not (self.distributed and dist.is_initialized()):
            return True
        if self._broken is not None or (self.ranks.rank == 0 and not self._released):
            return False
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the ranks did not all get here
            self._break("the ranks' last barrier failed", exc)
            return False
        return True

    # -- internals --------------------------------------------------------------------------------

    def _release_followers(self) -> bool:
        if self._broken is not None:
            return False
        if self._commands is not None:
            try:
                dist.broadcast_object_list([RankCommand(STOP)], src=0, group=self._commands)
            except Exception as exc:  # noqa: BLE001 - any failure of the command group breaks the ranks
                self._break("telling the other ranks to stop failed", exc)
                return False
        return True

    def _run(self, command: RankCommand) -> Any:
        self._last_command = time.monotonic()
        started = time.perf_counter()
        result, error, failure = None, None, None
        try:
            if command.op != NOOP:
                result = self.ops[command.op](self.state, *command.args)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below
            error, failure = f"{type(exc).__name__}: {exc}", exc
            if collective_failure(exc):
                # The other ranks are not where this one is: the exchange would only wait out the timeout again.
                self._op_failures.labels(command.op).inc()
                raise self._break(f"op {command.op!r} failed on rank {self.ranks.rank}", exc) from exc
        errors: list[str | None] = [error]
        if self._commands is not None:
            # Also for the heartbeat's no-op: a round trip of every rank, so a rank that hangs is found while idle.
            errors = [None] * self.ranks.world
            try:
                dist.all_gather_object(errors, error, group=self._commands)
            except Exception as exc:  # noqa: BLE001 - any failure of the command group breaks the ranks
                self._op_failures.labels(command.op).inc()
                after = "the heartbeat" if command.op == NOOP else f"op {command.op!r}"
                what = f"the ranks' exchange after {after} failed on rank {self.ranks.rank}"
                raise self._break(what, exc) from exc
        self._last_command = time.monotonic()
        if command.op == NOOP:
            return None
        self._op_seconds.labels(command.op).observe(time.perf_counter() - started)
        if failure is not None:
            self._op_failures.labels(command.op).inc()
            raise failure
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            self._op_failures.labels(command.op).inc()
            detail = "; ".join(f"rank {rank}: {e}" for rank, e in failed)
            raise RankOpFailed(f"op {command.op!r} failed on {detail}")
        return result

    def _break(self, what: str, exc: BaseException) -> RanksBroken:
        """Marks the ranks broken (the first cause stands), tells the listeners once; the error to raise."""
        with self._state_lock:
            why = self._broken
            first = why is None
            if why is None:
                why = self._broken = (
                    f"the trainer's ranks are out of step: {what} ({type(exc).__name__}: {exc}); the trainer must "
                    "be restarted (its runs resume from their last checkpoint)"
                )
            listeners, self._listeners = (self._listeners, []) if first else ([], self._listeners)
        if first:
            logger.error("rank %d: %s", self.ranks.rank, why)
        for listener in listeners:
            try:
                listener(why)
            except Exception:  # noqa: BLE001 - a listener's failure must not hide the ranks' failure
                logger.exception("a listener of the ranks' failure failed")
        return RanksBroken(why)

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise RanksBroken(self._broken)

    def _beat(self) -> None:
        while not self._stopped.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._last_command < self._heartbeat_s:
                continue
            try:
                self.call(NOOP)
            except RanksBroken:
                return  # said by _break; whoever listens ends the process
            except Exception:  # noqa: BLE001 - a stopped group ends the heartbeat, not the server
                if not self._stopped.is_set():
                    logger.exception("rank heartbeat failed; followers will time out")
                return
