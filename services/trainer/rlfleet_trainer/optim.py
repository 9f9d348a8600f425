"""AdamW with a learning-rate schedule: linear warmup, then constant, linear or cosine decay.

    warmup:   lr_s = lr * (s + 1) / W                                  for s < W
    constant: lr_s = lr
    linear:   lr_s = lr * (m + (1 - m) * (1 - p))                      p = (s - W) / (N - W)
    cosine:   lr_s = lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)

with s the optimizer update, W the warmup updates, N the run's updates and m the floor min_lr_ratio;
p stops at 1.

The schedule counts optimizer updates. A RunSpec counts steps (rollout batches) in schedule.steps and
trainer.warmup_steps, and a step takes trainer.mini_batches x trainer.epochs updates, so
`optimizer_from_spec` scales both by that; a skipped update (a gradient that was not finite) does not
advance it. The LambdaLR's position (`last_epoch`, the updates taken) is in every checkpoint, so a
resumed run continues on the same learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlfleet.v1.runs_pb2 import RunSpec

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    warmup_steps: int = 0
    """Optimizer updates of linear warmup."""
    kind: str = "constant"
    """constant, linear or cosine."""
    total_steps: int = 0
    """Optimizer updates of the run; the decay reaches its floor there."""
    min_lr_ratio: float = 0.0

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate at optimizer update `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "linear":
            decay = 1.0 - progress
        elif self.kind == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"unknown learning-rate schedule {self.kind!r}; use one of {list(SCHEDULES)}")
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def make_optimizer(
    model: torch.nn.Module,
    learning_rate: float,
    weight_decay: float,
    schedule: LrSchedule,
    start_step: int = 0,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """`start_step` continues the schedule of a resumed run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.99))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.factor(start_step + step))


def optimizer_from_spec(
    model: torch.nn.Module, spec: RunSpec, start_step: int = 0
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer and schedule a resolved RunSpec asks for, over the run's optimizer updates."""
    tr = spec.trainer
    per_step = max(1, tr.mini_batches) * max(1, tr.epochs)
    schedule = LrSchedule(
        warmup_steps=tr.warmup_steps * per_step,
        kind=tr.lr_schedule or "constant",
        total_steps=spec.schedule.steps * per_step,
        min_lr_ratio=tr.min_lr_ratio,
    )
    return make_optimizer(model, tr.learning_rate, tr.weight_decay, schedule, start_step)
