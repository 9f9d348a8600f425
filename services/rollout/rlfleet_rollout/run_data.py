"""A run's data position: which prompts each training step uses, and the held-out prompts of evaluation.

Step `s` uses train problems `[s * groups_per_step, (s + 1) * groups_per_step)` of the dataset's
seeded order, so an orchestrator that restarts mid-run produces the same groups for the same step.
"""

from __future__ import annotations

from functools import cached_property

from rlfleet.arithmetic import ArithmeticTask, Problem
from rlfleet.errors import InvalidInput
from rlfleet.v1.runs_pb2 import RunSpec


class RunData:
    def __init__(self, task: ArithmeticTask, *, groups_per_step: int, steps: int, eval_size: int) -> None:
        self.task = task
        self.groups_per_step = groups_per_step
        self.steps = steps
        self.eval_size = eval_size

    @classmethod
    def from_spec(cls, spec: RunSpec) -> RunData:
        """The data of a resolved, validated spec; InvalidInput when the dataset cannot serve it."""
        source = spec.dataset.WhichOneof("source")
        if source != "arithmetic":
            raise InvalidInput(f"dataset.{source}: this orchestrator serves `arithmetic` datasets only")
        ds = spec.dataset
        task = ArithmeticTask(digits=ds.arithmetic.digits, ops=ds.arithmetic.ops, seed=ds.seed)
        return cls(
            task, groups_per_step=spec.rollout.groups_per_step, steps=spec.schedule.steps, eval_size=ds.eval_size
        )

    def check(self) -> None:
        """Raises InvalidInput naming the field when a split is too small for the run (draws every prompt)."""
        try:
            _ = self.train_problems
        except ValueError as exc:
            raise InvalidInput(
                f"schedule.steps: {self.steps} steps x {self.groups_per_step} groups need more prompts than "
                f"the dataset holds: {exc}"
            ) from exc
        try:
            _ = self.eval_problems
        except ValueError as exc:
            raise InvalidInput(f"dataset.eval_size: {exc}") from exc

    @cached_property
    def train_problems(self) -> list[Problem]:
        return self.task.problems("train", self.steps * self.groups_per_step)

    @cached_property
    def eval_problems(self) -> list[Problem]:
        return self.task.problems("test", self.eval_size)

    def step_problems(self, step: int) -> list[Problem]:
        if not 0 <= step < self.steps:
            raise ValueError(f"step must be in [0, {self.steps}), got {step}")
        start = step * self.groups_per_step
        return self.train_problems[start : start + self.groups_per_step]
