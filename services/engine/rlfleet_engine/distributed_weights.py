"""The engine side of SGLang's distributed weight update: groups by name, tensors received in order, then loaded.

`/init_weights_update_group` joins the trainer's group (blocking until every rank has joined);
each `/update_weights_from_distributed` announces names, dtypes and shapes, receives exactly those
tensors from rank 0 (one broadcast each, or one flat bucket), and hands them to `apply`, which
loads them between two decode steps. A request that does not fit the model is refused before
anything is received, so the weights never change halfway for a bad request. A broadcast that
fails (a peer died, a timeout) leaves the group unusable: it is torn down and the caller is told
to open it again.

Network waits run in worker threads, never on the event loop or the scheduler thread, so the
engine keeps generating while a bucket is on the wire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import torch

from rlfleet.errors import InvalidInput, Unavailable
from rlfleet.weight_update_group import (
    FLATTENED_BUCKET,
    TensorSpec,
    WeightUpdateGroup,
    dtype_from_name,
    open_group,
    receive,
)
from rlfleet_engine.schemas import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
)

logger = logging.getLogger(__name__)

CheckTensors = Callable[[Sequence[tuple[str, tuple[int, ...]]], str], None]
ApplyTensors = Callable[[dict[str, torch.Tensor], UpdateWeightsFromDistributedRequest], Awaitable[int]]


class WeightReceiver:
    """Open groups by name and the updates received through them.

    `check` raises InvalidInput for tensors the model cannot take; `apply` loads received tensors
    (and the request's weight_version) and returns how many requests it held meanwhile. `timeout_s` bounds
    joining a group and each broadcast: a collective cannot be called off, so a receive whose sender gave up
    (another rank failed) ends only at this bound; then the group is dropped.
    """

    def __init__(
        self,
        check: CheckTensors,
        apply: ApplyTensors,
        abort_all: Callable[[], None],
        *,
        timeout_s: float,
        backends: Sequence[str] = ("gloo",),
    ) -> None:
        self._check = check
        self._apply = apply
        self._abort_all = abort_all
        self._backends = tuple(backends)
        self._timeout_s = timeout_s
        self._groups: dict[str, WeightUpdateGroup] = {}
        # Two updates through one group must not interleave their broadcasts.
        self._receiving = asyncio.Lock()

    @property
    def groups(self) -> list[str]:
        return sorted(self._groups)

    async def init_group(self, req: InitWeightsUpdateGroupRequest) -> str:
        if req.backend not in self._backends:
            raise InvalidInput(
                f"backend: {req.backend!r} is not available on this engine; it joins groups over "
                f"{', '.join(self._backends)} (NCCL needs the GPU engine, SGLang)"
            )
        old = self._groups.pop(req.group_name, None)
        if old is not None:  # a trainer that restarted opens its group again under the same name
            logger.info("replacing weight update group %s", req.group_name)
            old.abort()
        where = f"{req.master_address}:{req.master_port}"
        try:
            group = await asyncio.to_thread(
                open_group,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                req.group_name,
                req.backend,
                self._timeout_s,
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise Unavailable(
                f"could not join weight update group {req.group_name!r} at {where} as rank {req.rank_offset} "
                f"of {req.world_size} within {self._timeout_s:.0f}s: {exc}"
            ) from exc
        self._groups[req.group_name] = group
        return f"Succeeded to initialize custom process group {req.group_name!r} (rank {req.rank_offset})."

    async def update(self, req: UpdateWeightsFromDistributedRequest) -> tuple[str, int]:
        """Receives and loads the announced tensors; returns a message and the number of requests held."""
        group = self._groups.get(req.group_name)
        if group is None:
            raise InvalidInput(
                f"group_name: no weight update group {req.group_name!r} on this engine "
                f"(open: {self.groups or 'none'}); call /init_weights_update_group first"
            )
        specs = _specs(req)
        self._check([(s.name, s.shape) for s in specs], f"update through group {req.group_name!r}")
        if req.abort_all_requests:
            self._abort_all()
        async with self._receiving:
            try:
                tensors = await asyncio.to_thread(receive, group, specs, req.load_format == FLATTENED_BUCKET)
            except (RuntimeError, OSError) as exc:
                if self._groups.get(req.group_name) is group:
                    del self._groups[req.group_name]
                group.abort()
                raise Unavailable(
                    f"receiving {len(specs)} tensors through group {req.group_name!r} failed: {exc}; the group "
                    "is closed, open it again with /init_weights_update_group"
                ) from exc
            held = await self._apply(tensors, req)
        message = "Succeeded to update parameter online."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return message, held

    def destroy_group(self, req: DestroyWeightsUpdateGroupRequest) -> str:
        group = self._groups.pop(req.group_name, None)
        if group is None:
            raise InvalidInput(f"group_name: no weight update group {req.group_name!r} to destroy")
        group.close()
        return "Succeeded to destroy custom process group."


def _specs(req: UpdateWeightsFromDistributedRequest) -> list[TensorSpec]:
    specs = []
    for name, dtype, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
        try:
            specs.append(TensorSpec(name=name, dtype=dtype_from_name(dtype), shape=tuple(shape)))
        except ValueError as exc:
            raise InvalidInput(f"dtypes: tensor {name}: {exc}") from exc
    return specs
