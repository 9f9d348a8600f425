"""The one run a trainer process works on: its policy, optimizer, progress and step reports."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import StepReport, TrainerState, TrainerStatus


@dataclass
class ActiveRun:
    run_id: str
    spec: RunSpec
    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: PreTrainedModel | None
    stream: SampleStream
    weights_root: Path
    tokenizer_dir: Path
    pad_id: int
    step: int = 0
    weight_version: int = 0
    weights_path: str = ""
    groups_trained: int = 0
    state: TrainerState = TrainerState.TRAINER_STATE_STARTING
    error: str = ""
    reports: list[StepReport] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None

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
            )

    def update(self, **fields: object) -> None:
        """Sets fields and wakes everyone watching this run."""
        with self.changed:
            for name, value in fields.items():
                setattr(self, name, value)
            self.changed.notify_all()

    def add_report(self, report: StepReport) -> None:
        with self.changed:
            self.reports.append(report)
            self.changed.notify_all()

    def reports_from(self, step: int) -> list[StepReport]:
        with self.changed:
            return [r for r in self.reports if r.step >= step]

    @property
    def finished(self) -> bool:
        return self.state in (TrainerState.TRAINER_STATE_STOPPED, TrainerState.TRAINER_STATE_FAILED)
