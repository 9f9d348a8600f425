"""The engine side of SGLang's distributed weight update: groups by name, tensors received in order, then loaded.

`/init_weights_update_group` joins the trainer's group (blocking until every rank has joined);
each `/update_weights_from_distributed` announces names, dtypes and shapes, receives exactly those
tensors from rank 0 (one broadcast each, or one flat bucket), and hands them to `apply`, which
loads them between two decode steps. A request that does not fit the model is refused before
anything is received, so the weights never change halfway for a bad request. A broadcast that
fails (a peer died, a timeout) leaves the group unusable: it is torn down and the caller is told
to open it again.

A version travels in several updates (buckets). SGLang takes `weight_version` on any of them (slime
labels every bucket, our trainer only the last), and every one is received and applied alike. The
label, though, says the engine serves that version, so it advances only with an update after which
the names applied since the version began (since the last whole version, or since a group opened: a
version travels through one group) cover every parameter of the model (`parameters`, tied ones once);
until then the engine keeps its old label. A bucket lost on the way, or a tensor the trainer left out,
is so never served under the new label with its old value. Between a version's first bucket and a
whole version the engine holds a mix of two versions under its old label, and says so (`partial`:
`weights_partial` in the update's answer, /get_model_info and /get_server_info), so a router that
did not see the buckets (it restarted) still keeps it out of routing.

As SGLang from 0.5.23, updates are taken only inside a weight-update session, between `/begin_weight_update`
and `/end_weight_update` (one open at a time); outside one they are refused before anything is received.

Network waits run in worker threads, never on the event loop or the scheduler thread, so the
engine keeps generating while a bucket is on the wire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

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
from rlfleet_engine.weight_loading import missing_parameters

logger = logging.getLogger(__name__)

CheckTensors = Callable[[Sequence[tuple[str, tuple[int, ...]]], str], None]
ApplyTensors = Callable[[dict[str, torch.Tensor], UpdateWeightsFromDistributedRequest], Awaitable[int]]
MISSING_NAMED = 10
"""An answer names at most this many of the parameters a version still lacks."""


@dataclass(frozen=True)
class ReceivedUpdate:
    """What one /update_weights_from_distributed did: SGLang's message and held requests, and whether the engine
    now holds part of a version (its label does not describe its weights)."""

    message: str
    num_paused_requests: int
    weights_partial: bool


class WeightReceiver:
    """Open groups by name, the updates received through them, and how much of a version the engine holds.

    `check` raises InvalidInput for tensors the model cannot take; `apply` loads received tensors (and the
    request's weight_version, which it is handed only for an update that completes the version) and returns how
    many requests it held meanwhile. `parameters` are those a whole version must deliver (the backend's
    `parameter_names`); None (the sim: no model) checks nothing, and any labelled update ends its version.
    `timeout_s` bounds joining a group and each broadcast: a collective cannot be called off, so a receive whose
    sender gave up (another rank failed) ends only at this bound; then the group is dropped.
    """

    def __init__(
        self,
        check: CheckTensors,
        apply: ApplyTensors,
        abort_all: Callable[[], None],
        *,
        timeout_s: float,
        backends: Sequence[str] = ("gloo",),
        parameters: Mapping[str, str] | None = None,
    ) -> None:
        self._check = check
        self._apply = apply
        self._abort_all = abort_all
        self._backends = tuple(backends)
        self._timeout_s = timeout_s
        self._groups: dict[str, WeightUpdateGroup] = {}
        # Two updates through one group must not interleave their broadcasts.
        self._receiving = asyncio.Lock()
        self._parameters = parameters
        # Names applied since the version on its way began: its label waits until they cover `parameters`.
        self._delivered: set[str] = set()
        self._partial = False
        self._session_open = False

    @property
    def groups(self) -> list[str]:
        return sorted(self._groups)

    @property
    def partial(self) -> bool:
        """True while the weights hold tensors of a version that has not been completed (or never will be): the
        weight version the engine reports does not describe its weights then."""
        return self._partial

    def whole_version_loaded(self) -> None:
        """A whole version was loaded (from disk, or its last missing parameters over a group): whatever part of a
        version the engine held is gone, and the next update begins a version."""
        self._delivered.clear()
        self._partial = False

    async def init_group(self, req: InitWeightsUpdateGroupRequest) -> str:
        if req.backend not in self._backends:
            raise InvalidInput(
                f"backend: {req.backend!r} is not available on this engine; it joins groups over "
                f"{', '.join(self._backends)} (NCCL needs the GPU engine, SGLang)"
            )
        if req.group_name in self._groups:  # as SGLang: torch registers process groups by name
            raise InvalidInput(
                f"Failed to initialize custom process group: the group name {req.group_name!r} has already been "
                "created; destroy it first (/destroy_weights_update_group)"
            )
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
        # A version travels through one group: one begun before this opened cannot be completed through it.
        self._delivered.clear()
        return f"Succeeded to initialize custom process group {req.group_name!r} (rank {req.rank_offset})."

    def begin_session(self) -> str:
        """Opens the weight-update session updates need; one at a time, as SGLang."""
        if self._session_open:
            raise InvalidInput("a weight-update session is already open; call end_weight_update() first")
        self._session_open = True
        return "Success"

    def end_session(self) -> str:
        if not self._session_open:
            raise InvalidInput("no weight-update session is open; call begin_weight_update() first")
        self._session_open = False
        return "Success"

    async def update(self, req: UpdateWeightsFromDistributedRequest) -> ReceivedUpdate:
        """Receives and loads the announced tensors, under the request's weight_version if they complete it."""
        if not self._session_open:
            raise InvalidInput(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        group = self._groups.get(req.group_name)
        if group is None:
            raise InvalidInput(
                f"group_name: no weight update group {req.group_name!r} on this engine "
                f"(open: {self.groups or 'none'}); call /init_weights_update_group first"
            )
        specs = _specs(req)
        self._check([(s.name, s.shape) for s in specs], f"update through group {req.group_name!r}")
        async with self._receiving:
            if req.abort_all_requests:
                self._abort_all()
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
            # Counted here, under the lock: an update before this one may still have been applying.
            delivered = self._delivered.union(req.names)
            missing = [] if self._parameters is None else missing_parameters(self._parameters, delivered)
            whole = req.weight_version is not None and not missing
            try:
                held = await self._apply(tensors, req if whole else req.model_copy(update={"weight_version": None}))
            except BaseException:
                self._partial = True  # a load that failed or timed out may have changed some tensors
                raise
            if whole:
                self.whole_version_loaded()
            else:
                self._delivered = delivered
                self._partial = True
        message = "Succeeded to update parameter online."
        if whole:
            message += f" Weight version updated to {req.weight_version}."
        elif req.weight_version is not None:
            named = ", ".join(missing[:MISSING_NAMED]) + (", ..." if len(missing) > MISSING_NAMED else "")
            message += (
                f" Weight version not updated to {req.weight_version}: {len(missing)} of the model's parameters "
                f"have not arrived since the version began ({named}); the engine keeps its previous weight version "
                "until updates have delivered them all."
            )
        return ReceivedUpdate(message, held, self._partial)

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
