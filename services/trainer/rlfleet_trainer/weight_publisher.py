"""How each new weight version reaches the engines: one `publish` call per optimizer step.

disk: the version is written as a Hugging Face directory and the router has every engine load it.
distributed: the version is broadcast to the engines through a weight update group the trainer
opens once per run (and again when the fleet's membership changed). If the broadcast fails, the
same version goes the disk way, so a step never ends with the fleet behind it. Generation is paused
fleet-wide while a version travels, and until that disk load has ended: an engine that took some buckets holds
a mix of two versions meanwhile, and SGLang takes an update while it is not paused only once every generation
under way has ended, which the broadcast would wait for past its timeout. Once the engines serve a
broadcast version (generation resumed), the trainer writes it to disk too, for engines that rejoin (the
router holds them out of routing until that copy is registered) and for a router that restarted. That
copy is written in the background while the next step trains (weight_disk_copy.py), one at a time: the
next publish, a checkpoint and the run's end wait for it first, and raise its failure. Its tensors are
the version broadcast: a model that gives its live parameters as its state (one process, no FSDP) is
copied to CPU first (`private_state`: one more copy of the weights in memory until the copy is written).
A version that came from disk because the broadcast failed is written on the step path, as engines load it.

Either way `on_written` is told each version whose directory is complete and served (registered, for a copy),
from the thread that wrote it: until then the directory `publish` returns may not exist yet. A copy still being
written at its bound fails the run; if it ends after the run closed its weight sync, it is neither registered nor
loaded through the router, nor told: the run may have been resumed by then, the fleet serving another version.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel

from rlfleet.errors import Unavailable
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_broadcast import WeightBroadcaster, engine_dtype
from rlfleet_trainer.weight_disk_copy import DiskCopies, DiskCopyFailed, private_state
from rlfleet_trainer.weights import save_version, version_dir, without_tied_copies

logger = logging.getLogger(__name__)

FullState = Callable[[PreTrainedModel], Mapping[str, torch.Tensor]]
Written = Callable[[int, Path], None]
"""Told (version, directory) once a version's directory is complete and served."""


def _nobody_told(version: int, path: Path) -> None:
    return None


class WeightPublisher(Protocol):
    def publish(self, model: PreTrainedModel, version: int) -> Path:
        """Makes every engine serve `model` as `version`; returns the version's directory on disk, which may still
        be being written: complete once `on_written` is told it (see `settle`)."""
        ...

    def settle(self) -> None:
        """Waits (bounded) for what `publish` left under way (a disk copy); raises its failure."""
        ...

    def close(self) -> None:
        """Waits (bounded) for what is under way, then releases what the publisher holds for the run (the weight
        update group)."""
        ...


class DiskPublisher:
    def __init__(
        self,
        router: RouterClient,
        weights_root: Path,
        tokenizer_dir: Path,
        full_state: FullState = PreTrainedModel.state_dict,
        *,
        abort_all_requests: bool = False,
        on_written: Written = _nobody_told,
    ) -> None:
        self._router = router
        self._on_written = on_written
        # rollout.on_weight_update "abort_resume": the load aborts generations in flight.
        self._abort_all_requests = abort_all_requests
        self._weights_root = weights_root
        self._tokenizer_dir = tokenizer_dir
        # The whole (unsharded) state; a sharded model passes the function that gathers it.
        self._full_state = full_state

    def publish(self, model: PreTrainedModel, version: int) -> Path:
        return self.publish_state(model, self._full_state(model), version)

    def publish_state(self, model: PreTrainedModel, state: Mapping[str, torch.Tensor], version: int) -> Path:
        """Writes `state` (in `model`'s shape) as `version` and has every engine load it."""
        path = save_version(model, self._weights_root, version, self._tokenizer_dir, state)
        self.load(path, version)
        self._on_written(version, path)
        return path

    def load(self, path: Path, version: int) -> None:
        """Has every engine load `version`, written at `path` already."""
        self._router.load_weights(str(path), version, abort_all_requests=self._abort_all_requests)

    def settle(self) -> None:
        return None  # `publish` leaves nothing under way

    def close(self) -> None:
        return None


class DistributedPublisher:
    def __init__(
        self,
        broadcaster: WeightBroadcaster,
        disk: DiskPublisher,
        weights_root: Path,
        tokenizer_dir: Path,
        full_state: FullState = PreTrainedModel.state_dict,
        *,
        metrics: TrainerMetrics | None = None,
        disk_copy_timeout_s: float = TrainerSettings.model_fields["weight_disk_copy_timeout_s"].default,
        on_written: Written = _nobody_told,
    ) -> None:
        self._broadcaster = broadcaster
        self._on_written = on_written
        self._disk = disk
        self._weights_root = weights_root
        self._tokenizer_dir = tokenizer_dir
        self._full_state = full_state
        self._copies = DiskCopies(metrics or TrainerMetrics(), disk_copy_timeout_s)
        # A copy given up at its bound can end after `close`, the run failed on it and maybe resumed by then with the
        # fleet on another version: it then tells the router and the run nothing. Held while a copy tells them, so a
        # `close` never returns while one still does.
        self._telling = threading.Lock()
        self._closed = False

    def publish(self, model: PreTrainedModel, version: int) -> Path:
        """Broadcasts `version` and starts writing its disk copy in the background; returns the copy's directory,
        complete once `on_written` names it. Waits for the previous version's copy first, and raises its failure."""
        self._copies.wait()
        state = self._full_state(model)
        fallen_back = self.serve(model, state, version)
        if fallen_back is not None:
            return fallen_back
        # Taken now, on the training thread: the copy's thread reads neither the live parameters (the next step
        # changes them) nor the model's state (an FSDP2 state_dict() reshards the parameters mid-step).
        tensors = private_state(without_tied_copies(state, model), model)
        self._copies.start(version, lambda: self.write_disk_copy(model, tensors, version, untied=True))
        return version_dir(self._weights_root, version)

    def settle(self) -> None:
        self._copies.wait()

    def serve(self, model: PreTrainedModel, state: Mapping[str, torch.Tensor], version: int) -> Path | None:
        """Brings every engine to `version`: over the group, or from disk if the broadcast fails (the group is
        closed then). Returns the version's directory when it came from disk; None when it was broadcast
        (its disk copy is still to write)."""
        with self._broadcaster.engines_paused():
            try:
                if not self._broadcaster.is_current():
                    self._broadcaster.open()
                self._broadcaster.broadcast(without_tied_copies(state, model), version)
            except Unavailable as exc:
                logger.warning("broadcasting weight version %d failed (%s); loading it from disk instead", version, exc)
                self._broadcaster.close()
                # Still paused: engines that applied some buckets must not sample until they hold all of v.
                return self._disk.publish_state(model, state, version)
        return None

    def write_disk_copy(
        self, model: PreTrainedModel, state: Mapping[str, torch.Tensor], version: int, *, untied: bool = False
    ) -> Path:
        """Writes `version` (already served) to disk and tells the router, for engines that rejoin. A router that
        restarted since the broadcast knows no version: the engines load this copy through it instead, which
        gives it the fleet's version again. `untied`: as `save_version`'s."""
        path = save_version(model, self._weights_root, version, self._tokenizer_dir, state, untied=untied)
        with self._telling:
            if self._closed:
                raise DiskCopyFailed(
                    f"the disk copy of weight version {version} at {path} was written after the run's weight sync "
                    "was closed (the run failed on it at its bound); it is not registered with the router"
                )
            if not self._broadcaster.register_disk_copy(str(path), version):
                logger.warning(
                    "the router refused the disk copy of weight version %d: its fleet serves another version (it "
                    "restarted since the broadcast); loading version %d from %s through it",
                    version,
                    version,
                    path,
                )
                self._disk.load(path, version)
            self._on_written(version, path)
        return path

    def close(self) -> None:
        try:
            self._copies.wait()
        except DiskCopyFailed as exc:  # the run has ended (failed, if it met this copy's failure at a wait)
            logger.warning("closing the weight sync: %s", exc)
        with self._telling:
            self._closed = True
        self._broadcaster.close()


def make_publisher(
    settings: TrainerSettings,
    router: RouterClient,
    weights_root: Path,
    tokenizer_dir: Path,
    full_state: FullState = PreTrainedModel.state_dict,
    *,
    abort_all_requests: bool = False,
    base_model: Path | None = None,
    metrics: TrainerMetrics | None = None,
    on_written: Written = _nobody_told,
) -> WeightPublisher:
    """The publisher `settings.weight_sync` names, for one run (it opens its group on the first publish).
    `base_model`, the model the run started from: over NCCL its dtype is the one versions travel in. `metrics`: where
    the disk copies of broadcast versions are timed and counted. `on_written`: told each version whose directory is
    complete."""
    disk = DiskPublisher(
        router, weights_root, tokenizer_dir, full_state, abort_all_requests=abort_all_requests, on_written=on_written
    )
    if settings.weight_sync == "disk":
        return disk
    broadcaster = WeightBroadcaster(
        router,
        master_address=settings.weight_sync_address,
        backend=settings.weight_sync_backend,
        bucket_mb=settings.weight_sync_bucket_mb,
        timeout_s=settings.weight_sync_timeout_s,
        abort_all_requests=abort_all_requests,
        dtype=engine_dtype(settings.weight_sync_backend, base_model),
    )
    return DistributedPublisher(
        broadcaster,
        disk,
        weights_root,
        tokenizer_dir,
        full_state,
        metrics=metrics,
        disk_copy_timeout_s=settings.weight_disk_copy_timeout_s,
        on_written=on_written,
    )
