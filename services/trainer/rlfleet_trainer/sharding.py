"""FSDP2 for the policy: `fully_shard` on each transformer block, then on the root, a model built on
the meta device loaded shard by shard from rank 0's copy, and the full (unsharded) weights gathered
back for publishing.

Gradients are reduced as a SUM over ranks, not FSDP's default mean: each rank divides its loss by
the global batch's denominator (aggregation.py), so the summed gradient is exactly the gradient of
one pass over the whole batch on one rank. Plain SUM also works on gloo, which has no PREMUL_SUM.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a causal LM: modules of the classes Hugging Face marks as never to be
    split (`_no_split_modules`), else the children of the largest nn.ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if blocks:
        return blocks
    lists: list[nn.ModuleList] = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no _no_split_modules and no nn.ModuleList: cannot tell its blocks apart"
        )
    return list(max(lists, key=lambda blocks: len(list(blocks.children()))).children())


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Wraps each block so its activations are recomputed in the backward pass; returns the wrappers,
    which are what gets sharded (FSDP's hooks then stay outside the recomputed region).

    NO_REENTRANT keeps keyword arguments (attention masks, position embeddings) working, and state
    dicts drop the wrapper's name prefix, so checkpoints and published weights keep their names.
    """
    ids = {id(b) for b in blocks}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in ids,
    )
    return [m for m in model.modules() if isinstance(m, CheckpointWrapper) and id(m._checkpoint_wrapped_module) in ids]


def compute_device() -> torch.device:
    """The device this rank computes on: its GPU when there is one (under torchrun `init_process_group` made
    `cuda:LOCAL_RANK` current), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_model(model: nn.Module, mixed_precision: bool = False, activation_checkpointing: bool = False) -> nn.Module:
    """Shards `model` in place over the default process group (which must be initialised) and
    returns it. Parameters move to the local GPU when there is one.

    mixed_precision: compute in bf16 with fp32 master weights and fp32 gradient reduction.
    activation_checkpointing: recompute each block's activations in the backward pass.
    Both are for GPUs; on CPU they only cost time.
    """
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised process group (run under torchrun)")
    blocks = transformer_blocks(model)
    if activation_checkpointing:
        blocks = checkpoint_blocks(model, blocks)
    mesh = init_device_mesh(compute_device().type, (dist.get_world_size(),))
    precision = MixedPrecisionPolicy()  # parameters, compute and reduction all in the model's dtype
    if mixed_precision:
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def load_from_rank_0(
    model: nn.Module,
    source: nn.Module | None,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Shards `model`, built on the meta device on every rank (`policy.policy_skeleton`), materialises each rank's
    shard on its device and fills it from `source`, the same model loaded whole on rank 0 (None on the others), as
    torchtitan and `torch.distributed.checkpoint.state_dict` do it: rank 0 broadcasts one tensor at a time and
    every rank keeps its shard of it, so no other rank ever holds a whole copy. A collective; returns `model`.

    Buffers are no parameters and are not sharded: each rank holds them whole, and the non-persistent ones (a
    rotary embedding's `inv_freq`, computed in its __init__) are in no state dict, so `to_empty` leaves them
    uninitialised. All of them are broadcast from `source`'s, whatever computed them."""
    if not dist.is_initialized():
        raise RuntimeError("load_from_rank_0 needs an initialised process group (run under torchrun)")
    if (source is not None) != (dist.get_rank() == 0):
        raise ValueError("load_from_rank_0: rank 0, and only rank 0, passes the loaded model as source")
    # Named before sharding: activation checkpointing wraps the blocks, which renames their modules.
    buffers = [
        (f"{prefix}.{name}" if prefix else name, module, name)
        for prefix, module in model.named_modules()
        for name, _ in module.named_buffers(recurse=False)
    ]
    shard_model(model, mixed_precision, activation_checkpointing)
    model.to_empty(device=compute_device())
    full = source.state_dict() if source is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    loaded = dict(source.named_buffers(remove_duplicate=False)) if source is not None else {}
    with torch.no_grad():
        for qualified, module, name in buffers:
            buffer = getattr(module, name)
            if source is not None:
                buffer.copy_(loaded[qualified])
            dist.broadcast(buffer, src=0)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded weights of `model` on CPU, by parameter name.

    Under a process group this is a collective: every rank must call it, rank 0 gets the weights
    and the other ranks an empty dict. A plain module (no FSDP, no process group) works the same.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
