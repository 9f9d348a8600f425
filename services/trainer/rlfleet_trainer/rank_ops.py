"""The collective operations every trainer rank runs in lockstep (rank_group.py), over the state
one rank holds: its shard of the policy of the run being trained.

Each op is a function of (state, *args) that every rank runs with the same arguments; rank 0's
return value is what `RankGroup.call` returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_trainer.checkpoint import CheckpointMeta, TrainingState, load_checkpoint, save_checkpoint
from rlfleet_trainer.data_parallel import current_ranks
from rlfleet_trainer.optim import optimizer_from_spec
from rlfleet_trainer.policy import disable_dropout, load_policy, policy_skeleton
from rlfleet_trainer.rank_group import Op, on_every_rank
from rlfleet_trainer.sharding import compute_device, full_state_dict, load_from_rank_0
from rlfleet_trainer.train_step import StepConfig, step_config_from_spec, train_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardingOptions:
    mixed_precision: bool = False
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class Policy:
    """One rank's part of a run: the (sharded) model, its optimizer and schedule, the frozen
    reference, and the step configuration (which holds PPO's critic, replicated on every rank)."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: PreTrainedModel | None
    step: StepConfig
    pad_id: int


@dataclass
class RankState:
    options: ShardingOptions
    policy: Policy | None = None

    def require_policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("no run is loaded on this rank; load_run first")
        return self.policy


def process_group_ready() -> bool:
    """Whether this process is in a torchrun job's process group (which FSDP shards over)."""
    return dist.is_available() and dist.is_initialized()


def load_model(
    path: str | Path, options: ShardingOptions, trainable: bool, device: torch.device | None = None
) -> PreTrainedModel:
    """The model at `path` on this rank's device (`compute_device()` unless given).

    Sharded with FSDP2 over the ranks when there is more than one, and over the one rank of a GPU job too: the
    model only reaches the GPU there, and bf16 compute and activation checkpointing are FSDP's
    (`load_sharded_model`). One rank on the CPU keeps the model whole, computing exactly what it always did; a
    process without torchrun loads it on the CPU and moves it whole to its GPU, if it has one."""
    device = compute_device() if device is None else device
    if current_ranks().world > 1 or (device.type != "cpu" and process_group_ready()):
        return load_sharded_model(
            path, trainable, options.mixed_precision, options.activation_checkpointing and trainable
        )
    model = prepared(load_policy(path), trainable)
    if device.type != "cpu":
        torch.nn.Module.to(model, device)  # transformers types its `to` wrapper in a way mypy cannot call
    if trainable and (options.mixed_precision or options.activation_checkpointing):
        logger.warning(
            "--mixed-precision and --activation-checkpointing apply to a sharded model only (more than one rank, or "
            "a GPU under torchrun): this %s model computes in fp32 without them",
            device.type,
        )
    return model


def load_sharded_model(
    path: str | Path, trainable: bool, mixed_precision: bool, activation_checkpointing: bool
) -> PreTrainedModel:
    """The model at `path` sharded over the ranks, read from storage by rank 0 alone. Every rank builds it on the
    meta device (no memory) and shards it; rank 0 loads it whole on the CPU and hands each rank its shards. So a
    node of 8 ranks holds one whole copy while it loads, not 8 (a 7B model in fp32: 28 GB, not 224 GB).

    A failure to read the model (a config or weights that do not load) is raised on every rank, before any of
    them waits in the load's collectives."""
    parts: dict[str, PreTrainedModel] = {}
    rank_0 = dist.get_rank() == 0

    def read() -> None:
        parts["skeleton"] = policy_skeleton(path)
        if rank_0:
            parts["source"] = load_policy(path)

    on_every_rank(read)
    model = prepared(parts["skeleton"], trainable)
    # `requires_grad` is set before sharding, where the sharded parameters take it from.
    load_from_rank_0(model, parts.get("source"), mixed_precision, activation_checkpointing)
    return model


def prepared(model: PreTrainedModel, trainable: bool) -> PreTrainedModel:
    """`model` without dropout, and frozen in eval mode unless `trainable` (a run's reference)."""
    disable_dropout(model)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def load_run(state: RankState, spec: RunSpec) -> Policy:
    """Loads the run's policy from the spec's base model with a fresh optimizer and schedule (a
    resumed run then loads its checkpoint over them); the reference is the base model too."""
    torch.manual_seed(spec.trainer.seed)
    model = load_model(spec.model.path, state.options, trainable=True)
    # After sharding: the optimizer must hold the sharded parameters.
    optimizer, scheduler = optimizer_from_spec(model, spec)
    ref_model = load_model(spec.model.path, state.options, trainable=False) if spec.algorithm.kl_coef > 0 else None
    pad_id = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    state.policy = Policy(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        ref_model=ref_model,
        step=step_config_from_spec(spec, model, pad_id),
        pad_id=pad_id,
    )
    return state.policy


def train(state: RankState, groups: list[SampleGroup], step: int = 0) -> dict[str, float]:
    """Training step `step` of the run on the global batch `groups`; every rank trains on its share."""
    policy = state.require_policy()
    return train_step(policy.model, policy.optimizer, policy.scheduler, groups, policy.step, policy.ref_model, step)


def gather_weights(state: RankState) -> dict[str, torch.Tensor]:
    """The full weights on rank 0 (an empty dict on the others), for publishing."""
    return full_state_dict(state.require_policy().model)


def training_state(policy: Policy) -> TrainingState:
    return TrainingState(policy.model, policy.optimizer, policy.scheduler, policy.step.critic)


def checkpoint_save(state: RankState, root: str, meta: CheckpointMeta) -> Path:
    """Every rank writes its shards of the run's checkpoint as `<root>/step_<meta.step>`."""
    return save_checkpoint(Path(root), training_state(state.require_policy()), meta)


def checkpoint_load(state: RankState, path: str) -> CheckpointMeta:
    """Every rank restores its shards (and its RNG) from the checkpoint at `path`."""
    return load_checkpoint(Path(path), training_state(state.require_policy()))


def unload_run(state: RankState) -> None:
    """Frees the run's model and optimizer on this rank."""
    state.policy = None


RANK_OPS: dict[str, Op] = {
    "load_run": load_run,
    "train_step": train,
    "full_state_dict": gather_weights,
    "checkpoint_save": checkpoint_save,
    "checkpoint_load": checkpoint_load,
    "unload_run": unload_run,
}
