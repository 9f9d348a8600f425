"""The process group of a distributed weight update (SGLang's `/init_weights_update_group`) and its wire format.

The trainer is rank 0 and hosts the rendezvous, a TCPStore on master_address:master_port; engine
ranks join as rank_offset + their local rank. Every side builds the group as SGLang's engines do
(`init_custom_process_group` in sglang/srt/utils/common.py): the store under a prefix of the group's name,
then torch's own group constructor, registered under that name. Their keys must meet: gloo, say, connects
one group per device type torch gives it (cpu and cuda), each under its own prefix, and a group built any other
way waits on keys the engines never write. The group is a process group of its own, never the default one, so
a trainer under torchrun or an engine with tensor parallelism keeps its own. gloo on CPU and NCCL on GPU go
through the same calls.

The trainer and the engines must agree on the bytes, so both sides use `send` and `receive` here:
one broadcast per tensor in the order of `names`, or, with load_format "flattened_bucket", one
uint8 tensor holding every tensor's bytes back to back (SGLang's FlattenedTensorBucket layout).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, GroupName, _new_process_group_helper, _world

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
FLATTENED_BUCKET = "flattened_bucket"
"""The load_format under which a whole bucket travels as one flat byte tensor."""


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver allocates before a broadcast: the `names`/`dtypes`/`shapes` of one update request."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.element_size


_INTEGER_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def dtype_from_name(name: str) -> torch.dtype:
    """`float32`, `bfloat16` or `torch.float16` as a torch dtype; ValueError naming the text otherwise, or for a
    dtype no weight is sent in (quantized, complex, bit fields: gloo and NCCL cannot send them, and the failure
    broke the group)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    if not (dtype.is_floating_point or dtype in _INTEGER_DTYPES):
        raise ValueError(f"{name!r} is not a dtype weights are sent in (a floating-point or integer one)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's requests carry for `dtype` (`float32`, `bfloat16`, ...)."""
    return str(dtype).removeprefix("torch.")


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))


class Collective(Protocol):
    """What a group uses of its process group, called directly rather than through `dist.broadcast` (never the
    default group). torch's type stubs declare `broadcast` only on ProcessGroup, hence this protocol."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...

    def abort(self) -> None: ...


@dataclass
class WeightUpdateGroup:
    """One open group: this process's rank in it and the process group that carries the broadcasts."""

    name: str
    rank: int
    world_size: int
    backend: str
    process_group: Collective
    store: dist.Store  # rank 0's TCPStore serves the rendezvous for as long as the group lives
    timeout: datetime.timedelta

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0 sends `tensor`; every other rank receives into it. Bounded by the group's timeout."""
        self.process_group.broadcast(tensor, 0).wait(self.timeout)

    def close(self) -> None:
        """Releases the group's connections and its name (a group may open again under it); broadcasts on a
        closed group fail."""
        dist.destroy_process_group(cast(dist.ProcessGroup, self.process_group))

    def abort(self) -> None:
        """Tears the group down after a failed broadcast, without waiting for peers that may be gone; its name is
        free at once (a broadcast still pending ends at the group's timeout)."""
        self.process_group.abort()
        self.close()


def rendezvous(master_address: str, master_port: int, host: bool, timeout_s: float) -> dist.TCPStore:
    """The group's TCPStore: rank 0 hosts it (port 0 picks a free port, read back from `.port`), the others connect."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(master_address, master_port, is_master=host, timeout=timeout, wait_for_workers=False)


def join_group(
    store: dist.TCPStore, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> WeightUpdateGroup:
    """Returns once all `world_size` ranks have joined through `store`, or raises after `timeout_s`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported; use one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a weight update group named {group_name!r} is open in this process already")
    timeout = datetime.timedelta(seconds=timeout_s)
    options = None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    # As SGLang's engines build it (see the module's docstring): no global ranks, so torch takes the group for a
    # world of its own rather than a subgroup of this process's default group.
    process_group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=GroupName(group_name),
        backend_options=options,
        timeout=timeout,
    )
    _world.pg_group_ranks[process_group] = {r: r for r in range(world_size)}
    logger.info("joined weight update group %s as rank %d of %d (%s)", group_name, rank, world_size, backend)
    return WeightUpdateGroup(group_name, rank, world_size, backend, cast(Collective, process_group), store, timeout)


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> WeightUpdateGroup:
    """Joins (rank 0: hosts) the group at master_address:master_port; see `join_group`."""
    store = rendezvous(master_address, master_port, rank == 0, timeout_s)
    return join_group(store, rank, world_size, group_name, backend, timeout_s)


def send(group: WeightUpdateGroup, tensors: Sequence[torch.Tensor], flattened: bool) -> None:
    """Rank 0: broadcasts `tensors` in order, as receivers allocated them from the request's specs."""
    assert group.rank == 0, "only rank 0 (the trainer) sends"
    if flattened:
        group.broadcast(torch.cat([_as_bytes(t) for t in tensors]))
        return
    for tensor in tensors:
        group.broadcast(tensor.contiguous())


def receive(
    group: WeightUpdateGroup, specs: Sequence[TensorSpec], flattened: bool, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Engine ranks: receives the tensors `specs` describe, in order; returns them by name."""
    if flattened:
        flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=device)
        group.broadcast(flat)
        return unflatten(flat, specs)
    received: dict[str, torch.Tensor] = {}
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        group.broadcast(tensor)
        received[spec.name] = tensor
    return received


def unflatten(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of a flattened bucket, as views into `flat`."""
    out: dict[str, torch.Tensor] = {}
    start = 0
    for spec in specs:
        end = start + spec.nbytes
        chunk = flat[start:end]
        if start % spec.element_size:  # the layout has no padding: a misaligned slice is copied before the view
            chunk = chunk.clone()
        out[spec.name] = chunk.view(spec.dtype).reshape(spec.shape)
        start = end
    return out


def request_fields(named: Mapping[str, torch.Tensor]) -> dict[str, list[object]]:
    """The `names`, `dtypes` and `shapes` of an update request that announces `named`, in its order."""
    return {
        "names": list(named),
        "dtypes": [dtype_name(t.dtype) for t in named.values()],
        "shapes": [list(t.shape) for t in named.values()],
    }


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
