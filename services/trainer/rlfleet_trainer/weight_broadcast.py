"""Rank 0 of the distributed weight path: a group with every engine (through the router), versions sent in buckets.

Opening: the trainer hosts the rendezvous on a free port, asks the router to have its healthy engines join
(world_size 1 + their ranks, which the router counts: an engine with tensor parallelism takes tp_size), and
joins as rank 0; everyone returns once all have joined.
Publishing a version: the state is cut into buckets of at most `bucket_mb`; for each, the router
is asked to have every engine receive it (names, dtypes, shapes; one flat byte tensor per bucket,
SGLang's "flattened_bucket") while this process broadcasts it. Only the last bucket carries the
weight_version, so engines report the new version once they hold all of it. rlfleet-engine takes that label
only once the version's buckets delivered every parameter of its model, else it keeps its old one and answers
`weights_partial: true`, which the router counts as a failed bucket: a tensor left out fails the broadcast
(and the version arrives from disk) instead of being served with its previous value. With NCCL (GPU engines)
each bucket is copied to this rank's GPU as it goes, its floating-point tensors in the dtype the engines serve
(`engine_dtype`: the base model's, bf16 for most LLMs) rather than the trainer's fp32.

Each HTTP call runs in a thread beside the collective, and the collective in a thread of its own, so
whichever fails first ends the wait: a router that refuses a bucket (a member out of routing, a group it
closed) is reported at once, not after the group's timeout with the fleet paused. A pending gloo
collective cannot be called off (in torch 2.13 neither `abort()` nor `shutdown()` of a ProcessGroupGloo
ends a broadcast blocked on peers, and dropping the group waits for it); so the group is aborted (for
NCCL that is ncclCommAbort, which is meant to end pending work; not checked on a GPU here), never used
again, and its thread left to end at the group's timeout, or sooner when the engines close their end.
Opening waits `REFUSAL_WINDOW_S` for a quick refusal (an engine that is gone, a world_size that no
longer fits) before joining, so that common case leaves no join behind; a join that completes after its open failed
(the router failed once the engines had joined) is torn down, so the next open can take the group's name.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch

from rlfleet.errors import Unavailable
from rlfleet.weight_update_group import (
    FLATTENED_BUCKET,
    WeightUpdateGroup,
    dtype_from_name,
    join_group,
    rendezvous,
    request_fields,
    send,
)
from rlfleet_trainer.generation_pause import generation_paused
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weights import base_dtype

logger = logging.getLogger(__name__)

GROUP_NAME = "rlfleet-trainer"
REFUSAL_WINDOW_S = 1.0
"""How long opening waits for the router to refuse before joining (joining cannot be called off)."""


def unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without tensors that share storage with an earlier one (tied weights travel once)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` travels in: `dtype` for a floating-point tensor when one is given, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def buckets(
    state: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each on the wire, floating-point tensors sent in
    `dtype` when one is given (a larger tensor is a bucket by itself).

    Within a bucket the tensors go widest dtype (on the wire) first, in their order otherwise, so each starts in
    the flat bucket at a multiple of its element size: SGLang views its slice of the bytes as the dtype without a
    copy, which fails on a misaligned one (a float32 after an odd number of bfloat16 values)."""

    def element_size(tensor: torch.Tensor) -> int:
        return torch.empty((), dtype=wire_dtype(tensor, dtype)).element_size()

    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * element_size(tensor)
        if out[-1] and size + nbytes > bucket_bytes:
            out.append({})
            size = 0
        out[-1][name] = tensor
        size += nbytes
    return [dict(sorted(bucket.items(), key=lambda item: -element_size(item[1]))) for bucket in out if bucket]


def engine_dtype(backend: str, base_model: Path | None) -> torch.dtype | None:
    """The dtype floating-point weights are broadcast in: with NCCL (GPU engines, SGLang) the dtype the base
    model's config.json names, which the engines serve with `--dtype auto` and which every version's config.json
    names too (weights.py); None (the trainer's fp32) with gloo, whose CPU engines compute in fp32, or when the
    config names no reduced floating-point dtype.

    Under mixed precision the trainer keeps fp32 parameters: sent as they are, every bucket took twice the bytes
    over NCCL and twice the engine's GPU memory to receive, only for SGLang to round them to bf16 as it loads them
    (the same rounding as here). slime's FSDP broadcast casts to bf16 the same way."""
    if backend != "nccl" or base_model is None:
        return None
    name = base_dtype(base_model)
    try:
        dtype = dtype_from_name(name) if name is not None else None
    except ValueError:
        return None
    if dtype is None or not dtype.is_floating_point or dtype.itemsize >= 4:
        return None
    return dtype


class WeightBroadcaster:
    def __init__(
        self,
        router: RouterClient,
        master_address: str,
        backend: str,
        bucket_mb: float,
        timeout_s: float,
        group_name: str = GROUP_NAME,
        abort_all_requests: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`abort_all_requests`: each version's first bucket has the engines abort their requests
        first (the run resumes them on the new version: partial rollouts).
        `dtype`: the dtype floating-point tensors travel in (`engine_dtype`); None: the state's own."""
        self.dtype = dtype
        self._router = router
        self._abort_all_requests = abort_all_requests
        self._master_address = master_address
        self._backend = backend
        self._bucket_bytes = int(bucket_mb * 2**20)
        self._timeout_s = timeout_s
        self.group_name = group_name
        self.group: WeightUpdateGroup | None = None

    @property
    def device(self) -> str:
        return "cuda" if self._backend == "nccl" else "cpu"

    def open(self) -> None:
        """Opens the group with every healthy engine; raises Unavailable naming what failed."""
        self.close()
        # The router counts the ranks: an engine with tensor parallelism takes one per tp worker.
        world = self._get("/weights_update_world_size")
        world_size, engines = int(world["world_size"]), len(world["engines"])
        store = rendezvous(self._master_address, 0, host=True, timeout_s=self._timeout_s)
        body = {
            "master_address": self._master_address,
            "master_port": store.port,
            "world_size": world_size,
            "group_name": self.group_name,
            "backend": self._backend,
        }
        joined: list[WeightUpdateGroup] = []
        given_up = threading.Event()
        lock = threading.Lock()

        def join() -> None:
            group = join_group(store, 0, world_size, self.group_name, self._backend, self._timeout_s)
            with lock:
                joined.append(group)
                if given_up.is_set():  # the open failed meanwhile (the router died after the engines joined)
                    joined.pop().abort()

        def give_up() -> None:
            # A join the open gave up on can still complete: left registered, its name refused every later open.
            with lock:
                given_up.set()
                while joined:
                    joined.pop().abort()

        self._together("/init_weights_update_group", body, join, REFUSAL_WINDOW_S, abort=give_up)
        self.group = joined[0]
        logger.info("weight update group %s open with %d engines", self.group_name, engines)

    def is_current(self) -> bool:
        """True if the group is open and its members are still exactly the healthy engines."""
        if self.group is None:
            return False
        try:
            return bool(self._get(f"/weights_update_groups/{self.group_name}")["current"])
        except Unavailable as exc:
            logger.info("reopening weight update group %s: %s", self.group_name, exc)
            return False

    def broadcast(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Sends `state` to every engine in buckets; they serve `version` once this returns."""
        group = self.group
        if group is None:
            raise Unavailable("the weight update group is not open; call open() first")
        parts = buckets(unique_tensors(state), self._bucket_bytes, self.dtype)
        for index, bucket in enumerate(parts):
            last = index == len(parts) - 1
            # NCCL sends only from the GPU: each bucket is copied there (and cast to what the engines serve) as it goes.
            wire = {name: t.to(device=self.device, dtype=wire_dtype(t, self.dtype)) for name, t in bucket.items()}
            tensors = list(wire.values())
            body: dict[str, Any] = {
                **request_fields(wire),
                "group_name": self.group_name,
                "load_format": FLATTENED_BUCKET,
                "flush_cache": last,
                "weight_version": str(version) if last else None,
            }
            if index == 0 and self._abort_all_requests:
                body["abort_all_requests"] = True
            try:
                self._together(
                    "/update_weights_from_distributed",
                    body,
                    functools.partial(send, group, tensors, True),
                    refusal_window_s=0.0,
                    abort=group.abort,
                )
            except Unavailable:
                self.group = None
                raise
        logger.info("weight version %d broadcast in %d buckets", version, len(parts))

    @contextlib.contextmanager
    def engines_paused(self) -> Iterator[None]:
        """Generation paused fleet-wide while a version travels: no engine samples from a half-updated model, and
        SGLang takes an update while not paused only once every generation under way has ended; see
        `generation_paused` for how the pause is sure to end. Generations in flight are held, or aborted when the
        run resumes them itself (`abort_all_requests`)."""
        with generation_paused(self._router, "abort" if self._abort_all_requests else "retract"):
            yield

    def register_disk_copy(self, model_path: str, version: int) -> bool:
        """Tells the router where engines that rejoin load `version` (which arrived over the group) from;
        retried like a load from disk, within the same bound (the version is served already: a router
        restarting for a moment must not fail the run). False when the router refuses it because its fleet
        serves another version (409: it restarted since the broadcast and knows none)."""
        answer = self._router.post(
            "/weight_version/disk_copy",
            {"model_path": model_path, "weight_version": str(version)},
            f"register the disk copy of weight version {version} at {model_path}",
            settled=lambda status, _body: status == 409,
        )
        return answer.get("weight_version") == str(version)

    def close(self) -> None:
        """Closes the group on the engines (best effort) and here."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            self._post("/destroy_weights_update_group", {"group_name": self.group_name})
        except Unavailable as exc:
            logger.warning("could not close weight update group %s on the engines: %s", self.group_name, exc)
        group.close()

    # -- the router ---------------------------------------------------------------------------

    def _together(
        self,
        route: str,
        body: dict[str, Any],
        collective: Callable[[], None],
        refusal_window_s: float,
        abort: Callable[[], None],
    ) -> None:
        """POSTs `body` while `collective` runs, each in a thread; both must succeed. The first failure
        ends the wait: `abort` tears the group down and Unavailable says what failed."""
        done: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()
        answer: list[dict[str, Any] | Unavailable] = []

        def call() -> None:
            try:
                answer.append(self._post(route, body))
            except Unavailable as exc:
                answer.append(exc)
            done.put(("router", answer[0] if isinstance(answer[0], Unavailable) else None))

        def run() -> None:
            try:
                collective()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
                done.put(("collective", exc))
            else:
                done.put(("collective", None))

        caller = threading.Thread(target=call, name=f"router{route}", daemon=True)
        caller.start()
        if refusal_window_s > 0:
            caller.join(refusal_window_s)
            if answer and isinstance(answer[0], Unavailable):
                raise answer[0]
        threading.Thread(target=run, name=f"collective{route}", daemon=True).start()
        # The router answers within 2 x timeout (the call's own bound); the collective ends within the group's.
        deadline = time.monotonic() + 2 * self._timeout_s + 5.0
        pending = {"router", "collective"}
        while pending:
            try:
                side, error = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                abort()
                raise Unavailable(f"router {route}: no answer within {2 * self._timeout_s:.0f}s") from None
            pending.discard(side)
            if error is None:
                continue
            abort()
            if side == "router":
                raise error
            if not isinstance(error, (RuntimeError, OSError)):
                raise error
            refusal = f"; the router answered: {answer[0]}" if answer else ""
            failure = f"{type(error).__name__}: {error}"
            raise Unavailable(f"{route}: this trainer's side failed: {failure}{refusal}") from error

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        # One bucket's call lasts as long as its broadcast: bounded by the group's timeout plus the load.
        try:
            response = httpx.post(
                self._router.base_url + route, json=body, headers=self._router.headers, timeout=2 * self._timeout_s
            )
        except httpx.HTTPError as exc:
            raise Unavailable(f"router {self._router.base_url}{route}: {type(exc).__name__}: {exc}") from exc
        return _answer(route, response)

    def _get(self, route: str) -> dict[str, Any]:
        try:
            response = httpx.get(self._router.base_url + route, headers=self._router.headers, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            raise Unavailable(f"router {self._router.base_url}{route}: {type(exc).__name__}: {exc}") from exc
        return _answer(route, response)


def _answer(route: str, response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 2xx answer whose `success` is not false; Unavailable naming the failed engines otherwise."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict) and body.get("success", True) is not False:
        return body
    if isinstance(body, dict):
        failed = [f"{e.get('url')}: {e.get('message')}" for e in body.get("engines", []) if not e.get("success")]
        error = body.get("error")
        detail = str(body.get("message") or (error.get("message") if isinstance(error, dict) else error) or "")
        if failed:
            detail += f" ({'; '.join(failed)})"
    else:
        detail = response.text[:300]
    raise Unavailable(f"router {route}: HTTP {response.status_code}: {detail}")
