"""Learning-rate schedules by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet_trainer.optim import LrSchedule, make_optimizer


def test_warmup_then_constant() -> None:
    schedule = LrSchedule(warmup_steps=4)
    assert [schedule.factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_to_the_floor() -> None:
    linear = LrSchedule(warmup_steps=2, kind="linear", total_steps=10, min_lr_ratio=0.1)
    cosine = LrSchedule(warmup_steps=2, kind="cosine", total_steps=10, min_lr_ratio=0.1)
    assert [linear.factor(s) for s in (0, 1, 2, 4, 6, 10, 20)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.55, 0.1, 0.1]
    )
    assert [cosine.factor(s) for s in (2, 4, 6, 10)] == pytest.approx(
        [1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55, 0.1]
    )
    with pytest.raises(ValueError, match="unknown learning-rate schedule"):
        LrSchedule(kind="step", total_steps=10).factor(3)


def test_a_resumed_schedule_continues_where_it_stopped() -> None:
    model = torch.nn.Linear(2, 2)
    schedule = LrSchedule(warmup_steps=0, kind="linear", total_steps=4)
    optimizer, scheduler = make_optimizer(model, 1.0, 0.0, schedule, start_step=2)
    assert scheduler.get_last_lr() == [pytest.approx(0.5)]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(0.25)]
