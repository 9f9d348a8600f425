"""Checkpoints of a run with torch.distributed.checkpoint (DCP), in `<root>/step_<N>/`.

A checkpoint holds everything a step depends on, so training resumed from it takes the same steps
an uninterrupted run would: the policy, its optimizer and LR schedule, PPO's critic head and its
optimizer, the RNG state of every rank, and the trainer's position (step, weight version, groups
trained, last stream entry covered).

DCP reshards the model and optimizer, so a run can resume on a different number of ranks. The RNG
states are per rank: a rank that had none saved (the run resumes on more ranks) keeps the state the
run's seed gave it, and the states of ranks that are gone are not read.

Every file is summed (SHA-256, `checkpoint_checksums`) as it is written and checked before a load: DCP
would load a shard with a flipped bit as slightly different weights without a word.

The state dicts come from `torch.distributed.checkpoint.state_dict`, so the same code saves a plain
module (one process, no process group) and an FSDP2-sharded one (every rank calls `save_checkpoint`
and writes its own shards). A checkpoint is written under a temporary name and renamed into place,
so `step_<N>` exists only once it is complete.

DCP reports a failure (a full disk, an I/O error, tensors that do not fit the model) as its
CheckpointException, which is a BaseException: it would pass every `except Exception` between here
and the caller (the training thread, the rank protocol, the gRPC layer), killing the thread while
the run still says it trains. Both directions raise `CheckpointFailed`, an ordinary exception, instead.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlfleet_trainer.checkpoint_checksums import (
    SUMS_FILE,
    ChecksumMismatch,
    check_share,
    read_sums,
    sum_own_files,
    write_sums,
)
from rlfleet_trainer.critic import Critic
from rlfleet_trainer.directory_swap import replace_directory
from rlfleet_trainer.rank_group import on_every_rank, on_rank_0

STEP_PREFIX = "step_"
SUMS_KEPT = "sums_kept"
"""A key of the checkpoints saved with their SHA-256 sums (all but the oldest), in their DCP metadata."""

logger = logging.getLogger(__name__)


class CheckpointFailed(RuntimeError):
    """A DCP save or load failed on some rank; `causes` are the ranks' own errors."""

    def __init__(self, message: str, causes: list[BaseException]) -> None:
        super().__init__(message)
        self.causes = causes

    @property
    def damaged(self) -> bool:
        """The checkpoint itself is broken for good: a shard missing, one torch cannot read (truncated: the
        stream ends early, EOFError or PytorchStreamReader; overwritten: what is read is no pickle), or one
        that differs from the sum it was saved with."""
        return any(
            isinstance(cause, (FileNotFoundError, EOFError, pickle.UnpicklingError, ChecksumMismatch))
            or (isinstance(cause, RuntimeError) and "PytorchStreamReader" in str(cause))
            for cause in self.causes
        )

    @property
    def storage(self) -> bool:
        """The storage failed (disk full, EIO) rather than the checkpoint not fitting the state."""
        return any(isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError) for cause in self.causes)


@dataclass(frozen=True)
class CheckpointMeta:
    """The trainer's position that a checkpoint covers."""

    step: int = 0
    weight_version: int = 0
    groups_trained: int = 0
    """Groups trained from the start of the run through `step`."""
    last_entry_id: str = ""
    """Last stream entry the checkpoint covers (every covered entry is acknowledged)."""


@dataclass(frozen=True)
class TrainingState:
    """The objects whose state a checkpoint captures; restored in place."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: Critic | None = None


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


@contextmanager
def _dcp_call(action: str) -> Iterator[None]:
    """Runs a DCP save or load: its failure raised as CheckpointFailed, and without the warning DCP
    gives on every call without a process group (one process is an intended mode here)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            yield
    except CheckpointException as exc:
        failures = [(rank, error) for rank, (error, _trace) in sorted(exc.failures.items())]
        detail = "; ".join(f"rank {rank}: {type(error).__name__}: {error}" for rank, error in failures)
        raise CheckpointFailed(f"{action} failed: {detail}", [error for _, error in failures]) from exc


def _rng_state() -> dict[str, torch.Tensor]:
    # Keyed by rank: ranks draw different numbers, and DCP would keep only one copy of a shared key.
    rank = _rank()
    state = {f"torch_rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available():
        state[f"cuda_rank{rank}"] = torch.cuda.get_rng_state()
    return state


def _model_and_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any, bool]:
    """`get_state_dict`'s two parts, and whether the optimizer had taken no update yet. Such an optimizer is given
    state by a step at learning rate 0, which AdamW counts as its first: forgotten again here, so a checkpoint
    taken before the first update (a stop while the run waits for its first groups) leaves training as it was."""
    fresh = not optimizer.state
    model_state, optimizer_state = get_state_dict(model, optimizer)
    if fresh:
        optimizer.state.clear()
    return model_state, optimizer_state, fresh


def _state_dict(parts: TrainingState, meta: CheckpointMeta | None) -> dict[str, Any]:
    model_state, optimizer_state, fresh = _model_and_optimizer(parts.model, parts.optimizer)
    state: dict[str, Any] = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": parts.scheduler.state_dict(),
        "rng": _rng_state(),
        "fresh_optimizers": {"policy": fresh},
    }
    if parts.critic is not None:
        head_state, head_optimizer_state, fresh = _model_and_optimizer(parts.critic.head, parts.critic.optimizer)
        state["critic"] = {"head": head_state, "optimizer": head_optimizer_state}
        state["fresh_optimizers"]["critic"] = fresh
    if meta is not None:
        state["trainer"] = asdict(meta)
    return state


def save_checkpoint(root: Path, parts: TrainingState, meta: CheckpointMeta) -> Path:
    """Writes `parts` and `meta` as `<root>/step_<meta.step>` and returns that directory.

    Under a process group every rank must call this (DCP is collective); rank 0's `meta` is the one
    written, and rank 0 alone prepares the directory and renames it into place: its failure there is
    raised on every rank. An existing directory of the same step (left by a run that crashed before
    recording it) is replaced."""
    dest = checkpoint_dir(root, meta.step)
    tmp = root / f".{dest.name}.tmp"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    # Rank 0's own steps share their outcome (a full or failing disk fails the save on every rank at once, with
    # its cause); that is also the barrier: nobody writes into the temporary directory before rank 0 has emptied it.
    on_rank_0(prepare)
    state = _state_dict(parts, meta if _rank() == 0 else None)
    state[SUMS_KEPT] = True  # in the metadata: without its sums file, such a checkpoint is damaged, not old
    with _dcp_call(f"writing checkpoint {dest}"):
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
    # dcp.save returns on rank 0 after every rank's shards and the metadata are written; each rank wrote its own.
    rank = _rank()
    sums = {name: digest for part in on_every_rank(lambda: sum_own_files(tmp, rank)) for name, digest in part.items()}

    def finish() -> None:
        write_sums(tmp, sums)
        replace_directory(tmp, dest)

    on_rank_0(finish)
    return dest


def load_checkpoint(path: Path, parts: TrainingState) -> CheckpointMeta:
    """Restores `parts` (and this rank's RNG) from the checkpoint at `path`; returns its position."""
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint at {path} (its .metadata file is missing)")
    _check_sums(path)
    state = _state_dict(parts, CheckpointMeta())
    saved = _saved_keys(path)
    state["rng"] = {key: value for key, value in state["rng"].items() if f"rng.{key}" in saved}
    if not any(key.startswith("fresh_optimizers.") for key in saved):  # written before it was recorded
        del state["fresh_optimizers"]
    with _dcp_call(f"reading checkpoint {path}"):
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    fresh = state.get("fresh_optimizers", {})
    set_state_dict(parts.model, parts.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if fresh.get("policy"):
        parts.optimizer.state.clear()
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.critic is not None:
        critic = state["critic"]
        set_state_dict(
            parts.critic.head,
            parts.critic.optimizer,
            model_state_dict=critic["head"],
            optim_state_dict=critic["optimizer"],
        )
        if fresh.get("critic"):
            parts.critic.optimizer.state.clear()
    _restore_rng(state["rng"], path)
    return CheckpointMeta(**state["trainer"])


def _check_sums(path: Path) -> None:
    """Every rank checks its share of the checkpoint's files against their saved sums; a file missing or changed
    is CheckpointFailed (damaged) on every rank. A checkpoint saved before the sums were kept loads unchecked; one
    whose metadata says it was saved with them and that has none lost them (a partial copy) and is damaged."""
    rank, world_size = _rank(), _world_size()

    def check() -> bool:
        sums = read_sums(path)
        if sums is not None:
            check_share(path, sums, rank, world_size)
            return True
        try:
            saved_with_sums = SUMS_KEPT in _saved_keys(path)
        except Exception:  # noqa: BLE001 - metadata DCP cannot read: its own read reports what it meets
            return False
        if saved_with_sums:
            raise ChecksumMismatch(f"{path / SUMS_FILE} is missing, and the checkpoint was saved with it")
        return False

    try:
        summed = on_every_rank(check)
    except (ChecksumMismatch, FileNotFoundError) as exc:
        raise CheckpointFailed(f"reading checkpoint {path} failed: {exc}", [exc]) from exc
    if not all(summed) and rank == 0:
        logger.warning("checkpoint %s carries no SHA-256 sums (saved by an older trainer): loading it unchecked", path)


def _saved_keys(path: Path) -> set[str]:
    """The flattened keys the checkpoint at `path` holds (`rng.torch_rank0`, `fresh_optimizers.policy`, ...)."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _restore_rng(saved: dict[str, torch.Tensor], path: Path) -> None:
    rank = _rank()
    wanted = [f"torch_rank{rank}"] + ([f"cuda_rank{rank}"] if torch.cuda.is_available() else [])
    missing = [key for key in wanted if key not in saved]
    if missing:
        logger.warning(
            "checkpoint %s holds no RNG state %s (saved by fewer ranks, or without CUDA): keeping the seeded one",
            path,
            ", ".join(missing),
        )
    if f"torch_rank{rank}" in saved:
        torch.set_rng_state(saved[f"torch_rank{rank}"])
    if f"cuda_rank{rank}" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved[f"cuda_rank{rank}"])


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Loads only the policy's weights of the checkpoint at `path` into `model` (any sharding), all of them: a
    checkpoint holding policy tensors `model` has no place for, or different tensors under two names `model` ties,
    is CheckpointFailed (not damaged) rather than a model missing part of what was trained."""
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint at {path} (its .metadata file is missing)")
    _check_sums(path)
    weights: dict[str, Any] = get_model_state_dict(model)
    # DCP reads the keys asked for and skips the others: a model of fewer layers (of the same width) would take
    # the first ones and drop the rest without a word.
    saved = sorted(key.removeprefix("model.") for key in _saved_keys(path) if key.startswith("model."))
    unplaced = [name for name in saved if name not in weights]
    if unplaced:
        more = f" and {len(unplaced) - 3} more" if len(unplaced) > 3 else ""
        raise CheckpointFailed(
            f"checkpoint {path} holds policy tensors the model has no place for: {', '.join(unplaced[:3])}{more}", []
        )
    # A tied parameter appears under each of its names; read into one tensor, the copy read last would win.
    tied = {name: first for name, first in _tied_names(model).items() if name in weights and first in weights}
    for name in tied:
        weights[name] = torch.empty_like(weights[name])
    state = {"model": weights}
    with _dcp_call(f"reading checkpoint {path}"):
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    for name, first in tied.items():
        if not torch.equal(weights[name], weights[first]):
            raise CheckpointFailed(
                f"checkpoint {path} holds different tensors as {first} and {name}, which the model ties "
                "(tie_word_embeddings)",
                [],
            )
    set_model_state_dict(model, weights | {name: weights[first] for name, first in tied.items()})


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """The names under which `model` holds a parameter it holds under an earlier name too, each to that name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        earlier = first.setdefault(id(tensor), name)
        if earlier != name:
            tied[name] = earlier
    return tied


def checkpoint_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, oldest first."""
    if not root.exists():
        return []
    steps = []
    for path in root.iterdir():
        suffix = path.name.removeprefix(STEP_PREFIX)
        if path.name.startswith(STEP_PREFIX) and suffix.isdigit():
            steps.append(int(suffix))
    return sorted(steps)


def prune_checkpoints(root: Path, newest: int, keep: int) -> None:
    """Keeps the `keep` latest checkpoints up to step `newest` (the one the run's record names); later ones are
    left alone (`set_aside_after` moves them). Directories of interrupted saves and replacements go too."""
    for pattern in (f".{STEP_PREFIX}*.tmp", f".{STEP_PREFIX}*.replaced*"):
        for path in root.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
    older = [s for s in checkpoint_steps(root) if s <= newest]
    for step in older[: max(0, len(older) - keep)]:
        shutil.rmtree(checkpoint_dir(root, step), ignore_errors=True)


def set_aside(root: Path) -> Path | None:
    """Moves the checkpoints under `root` aside, next to it (`<root>.unrecorded-<UTC time>`), when a run starts
    afresh over them; returns where, or None when there were none. Its first checkpoint would otherwise be the
    run's record, over checkpoints of a run whose record Redis lost (emptied, restored from an old snapshot, another
    --redis-prefix), or that a trainer wrote before it died without recording them."""
    return set_aside_after(root, -1)


def set_aside_after(root: Path, newest: int) -> Path | None:
    """Moves the checkpoints under `root` of steps after `newest` aside, into `<root>.unrecorded-<UTC time>` next
    to it; returns where, or None when there were none. A run resumed from the checkpoint its record names (step
    `newest`) writes the later steps again: a trainer died before recording them, or Redis was restored from an
    older snapshot than they are, when they may hold hours of training that only they have."""
    later = [s for s in checkpoint_steps(root) if s > newest]
    if not later:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = root.with_name(f"{root.name}.unrecorded-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = root.with_name(f"{root.name}.unrecorded-{stamp}-{n}")
    aside.mkdir()
    for step in later:
        checkpoint_dir(root, step).rename(checkpoint_dir(aside, step))
    return aside
