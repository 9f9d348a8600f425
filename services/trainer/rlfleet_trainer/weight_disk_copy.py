"""The disk copy of a broadcast weight version, written in the background while the next step trains.

A version that reached the engines over the weight update group still needs a copy on disk: engines that rejoin
load it (the router holds them out of routing until it is registered) and a router that restarted is given the
version through it. Written on the step path it cost the trainer's step as much as the broadcast (2.3 s at 100M
parameters, ~14 GB per step at 7B in bf16: bench/weight_sync.md), which trainers syncing over NCCL do not pay.

So the copy is written by a thread of its own, at most one at a time: whoever needs it written waits for it first,
bounded by `timeout_s` (the next publish, before it gathers and broadcasts the next version; a checkpoint; the run's
end). Copies therefore never pile up and never reach the router out of order: the copy of v is registered before v+1
is broadcast, so the router never takes a late copy of v for the fleet's version. A copy that fails (a full disk, a
router that refused it for good) is logged and counted when it fails, and raised, once, to the first wait after it:
the run fails there as it did when the copy was written on the step path.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rlfleet.errors import Unavailable
from rlfleet_trainer.metrics import TrainerMetrics

logger = logging.getLogger(__name__)


def private_state(state: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state` with a CPU copy of every tensor that shares memory with one of `model`'s parameters or buffers, so
    the next optimizer step cannot change it while it is written.

    A model on one process (no FSDP) gives its state as views of its live parameters: those are copied, one extra
    CPU copy of the weights (4 bytes a parameter in fp32) held until the copy is written. The full state FSDP gathers
    on rank 0 (`sharding.full_state_dict`, offloaded to CPU) is new memory already: kept as it is. Told apart by
    memory, not by path, so a tensor that is a parameter's own memory is copied whichever path gave it."""
    live = {_storage(t) for t in itertools.chain(model.parameters(), model.buffers())}
    return {
        name: tensor.detach().to("cpu", copy=True) if _storage(tensor) in live else tensor
        for name, tensor in state.items()
    }


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    """Where `tensor`'s memory starts (device, address); a DTensor's is its local shard's."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return str(local.device), local.untyped_storage().data_ptr()


class DiskCopyFailed(Unavailable):
    """The disk copy of a broadcast weight version was not written and registered with the router (in time)."""


class DiskCopies:
    """The disk copy in flight, if any. Used by the training thread only; the copy's own thread writes it."""

    def __init__(self, metrics: TrainerMetrics, timeout_s: float) -> None:
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._version = 0
        self._started = 0.0
        self._failure: BaseException | None = None
        self._overdue = False  # a wait ran out on the copy in flight: later waits do not wait for it again

    def start(self, version: int, write: Callable[[], Path]) -> None:
        """Writes the copy of `version` in the background: `write()` writes it and registers it with the router.
        The copy before it must have been waited for."""
        if self._thread is not None:
            raise RuntimeError(f"the disk copy of weight version {self._version} was not waited for")
        self._version, self._started, self._failure, self._overdue = version, time.monotonic(), None, False
        self._metrics.weight_disk_copy_in_flight.set(1)
        self._thread = threading.Thread(target=self._write, args=(version, write), name=f"disk-copy-v{version}")
        self._thread.daemon = True  # the version is served already; a process that ends mid-write leaves no v<N>
        self._thread.start()

    def wait(self) -> None:
        """Waits, up to the bound, for the copy in flight; raises DiskCopyFailed if it failed (once: the wait after
        that one finds none) or is still going on at the bound."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive() and not self._overdue:
            waited = time.monotonic()
            logger.info(
                "waiting for the disk copy of weight version %d (written for %.1fs so far)",
                self._version,
                waited - self._started,
            )
            thread.join(timeout=max(0.0, self._started + self._timeout_s - waited))
            self._metrics.weight_disk_copy_wait_seconds.observe(time.monotonic() - waited)
        if thread.is_alive():
            self._overdue = True
            raise DiskCopyFailed(
                f"the disk copy of weight version {self._version} is still being written or registered with the "
                f"router after {time.monotonic() - self._started:.0f}s (weight_disk_copy_timeout_s "
                f"{self._timeout_s:g}); engines that rejoin cannot load the fleet's version until it is"
            )
        self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise DiskCopyFailed(
                f"the disk copy of weight version {self._version} failed: {type(failure).__name__}: {failure}"
            ) from failure

    def _write(self, version: int, write: Callable[[], Path]) -> None:
        try:
            path = write()
        except BaseException as exc:  # noqa: BLE001 - kept for the training thread, which raises it at its next wait
            self._failure = exc
            self._metrics.weight_disk_copy_failures.inc()
            logger.error(
                "the disk copy of weight version %d failed (%s: %s); the run fails at its next publish, checkpoint "
                "or end",
                version,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, (OSError, Unavailable)),
            )
        else:
            elapsed = time.monotonic() - self._started
            self._metrics.weight_disk_copy_seconds.observe(elapsed)
            logger.info("disk copy of weight version %d written and registered at %s (%.2fs)", version, path, elapsed)
        finally:
            self._metrics.weight_disk_copy_in_flight.set(0)
