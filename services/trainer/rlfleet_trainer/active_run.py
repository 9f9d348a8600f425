"""The one run a trainer process works on: its policy, optimizer, progress and step reports.

The training thread owns the model; other threads (the gRPC handlers) read progress and ask for a
checkpoint through this object, which the training thread takes at its next step boundary.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from transformers import PreTrainedModel

from rlfleet.errors import Conflict, DeadlineExceeded
from rlfleet.sample_stream import SampleStream, StreamEntry
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import CheckpointResponse, StepReport, TrainerState, TrainerStatus
from rlfleet_trainer.rank_group import RankGroup
from rlfleet_trainer.rank_ops import Policy, RankState

# Step reports a run keeps (a follower of WatchSteps reconnecting asks for those after the last it copied): they
# grew by one a step for as long as the run lived.
KEPT_REPORTS = 10_000


@dataclass
class ActiveRun:
    run_id: str
    spec: RunSpec
    ranks: RankGroup
    """Every rank's part of the policy; collective work on it goes through `ranks.call`."""
    stream: SampleStream
    weights_root: Path
    checkpoints_root: Path
    tokenizer_dir: Path
    policy: Policy | None = None
    """What load_run gave this run on rank 0: its policy is unloaded only while the ranks still hold this one."""
    step: int = 0
    weight_version: int = 0
    weights_path: str = ""
    """A complete weight directory, of version `weights_version` (`v<N>` under `weights_root`; model.path for 0)."""
    weights_version: int = 0
    """The newest version the run has reported whose directory is complete: `weight_version`, or the one before
    while that version's disk copy is written in the background (weight_sync=distributed), and for good if it failed.
    Never a later one, nor one being written: whoever loads `weights_path` (an operator, the fleet check) loads it
    whole."""
    weights_ahead: tuple[int, str] | None = None
    """A version whose directory was complete before the run reported it (its checkpoint was being taken), with that
    directory: `weights_path` names it once the run reports the version."""
    groups_trained: int = 0
    checkpoint_step: int = 0
    checkpoint_path: str = ""
    last_entry_id: str = ""
    """Last stream entry the last checkpoint covers."""
    uncommitted: list[str] = field(default_factory=list)
    """Stream entries trained since the last checkpoint: pending until a checkpoint covers them."""
    cursor: str = "0"
    """Last of this consumer's pending entries taken for training; the next step reads after it."""
    claimed_behind: list[StreamEntry] = field(default_factory=list)
    """Entries claimed from another consumer with ids at or before `cursor`, not yet trained: the next steps take
    them first, as reading after the cursor never would (they stayed pending here until a restart)."""
    checkpoint_wanted: bool = False
    checkpoint_on_stop: bool = False
    state: TrainerState = TrainerState.TRAINER_STATE_STARTING
    error: str = ""
    reports: deque[StepReport] = field(default_factory=lambda: deque(maxlen=KEPT_REPORTS))
    """The latest step reports, for WatchSteps to replay to a follower that reconnects."""
    stop: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None

    @property
    def model(self) -> PreTrainedModel:
        """Rank 0's model (its shard under FSDP): the config and shape weights are written in."""
        return cast(RankState, self.ranks.state).require_policy().model

    def status(self) -> TrainerStatus:
        with self.changed:
            return TrainerStatus(
                run_id=self.run_id,
                state=self.state,
                step=self.step,
                weight_version=self.weight_version,
                weights_path=self.weights_path,
                groups_trained=self.groups_trained,
                error=self.error,
                checkpoint_step=self.checkpoint_step,
                checkpoint_path=self.checkpoint_path,
                weights_version=self.weights_version,
            )

    def update(self, **fields: object) -> None:
        """Sets fields and wakes everyone watching this run."""
        with self.changed:
            for name, value in fields.items():
                setattr(self, name, value)
            self._name_weights_ahead()
            self.changed.notify_all()

    def weights_written(self, version: int, path: Path) -> None:
        """Version `version`'s directory `path` is complete (told by the thread that wrote it): Status names it as
        soon as the run has reported that version."""
        with self.changed:
            self.weights_ahead = (version, str(path))
            self._name_weights_ahead()
            self.changed.notify_all()

    def _name_weights_ahead(self) -> None:
        if self.weights_ahead is not None and self.weights_ahead[0] <= self.weight_version:
            self.weights_version, self.weights_path = self.weights_ahead
            self.weights_ahead = None

    def complete_step(self, report: StepReport, **fields: object) -> None:
        """Records a step's report and sets `fields` (its step, version, ...) under one lock: no reader sees the
        run at a step whose report is missing."""
        with self.changed:
            self.reports.append(report)
            self.update(**fields)

    def reports_from(self, step: int) -> list[StepReport]:
        with self.changed:
            return [r for r in self.reports if r.step >= step]

    def want_checkpoint(self) -> None:
        """Asks the training thread for a checkpoint at its next step boundary (at once while it waits for
        groups), unless one covers every step taken so far; waits for nothing."""
        with self.changed:
            if not self._covers(self.step) and not self.finished:
                self.checkpoint_wanted = True
                self.changed.notify_all()

    def _covers(self, step: int) -> bool:
        return bool(self.checkpoint_path) and self.checkpoint_step >= step

    def request_checkpoint(self, timeout_s: float) -> CheckpointResponse:
        """Waits until a checkpoint covers every step taken so far; the training thread takes it at
        its next step boundary (at once while it waits for groups)."""
        with self.changed:
            target = self.step

            def covered() -> bool:
                return self._covers(target)

            if not covered() and not self.finished:
                self.want_checkpoint()
                if not self.changed.wait_for(lambda: covered() or self.finished, timeout=timeout_s):
                    raise DeadlineExceeded(
                        f"run {self.run_id}: no checkpoint of step {target} within {timeout_s:.0f}s "
                        "(the step in progress has not ended); ask again"
                    )
            if not covered():
                raise Conflict(
                    f"run {self.run_id} ended at step {self.step} without a checkpoint of it"
                    + (f" ({self.error})" if self.error else "")
                    + (f"; its last checkpoint is step {self.checkpoint_step}" if self.checkpoint_path else "")
                )
            # Weight version v is the policy after step v, here as after a resume.
            return CheckpointResponse(
                path=self.checkpoint_path, step=self.checkpoint_step, weight_version=self.checkpoint_step
            )

    @property
    def finished(self) -> bool:
        return self.state in (TrainerState.TRAINER_STATE_STOPPED, TrainerState.TRAINER_STATE_FAILED)

    @property
    def releasing(self) -> bool:
        """Ended, and its thread still letting go of what it holds (the weight sync with the fleet, the policy on
        the ranks): no other run may load meanwhile, or this run's unload would throw that one away."""
        return self.finished and self.thread is not None and self.thread.is_alive()

    def wait_released(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the run's thread to end; whether it holds nothing any more."""
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)
        return self.thread is None or not self.thread.is_alive()
