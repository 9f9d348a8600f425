"""The trainer's metrics before any run: no step values, rather than zeros that read as values."""

from __future__ import annotations

import math

from rlfleet_trainer.metrics import STEP_GAUGES, TrainerMetrics


def test_step_gauges_are_none_before_the_first_run() -> None:
    metrics = TrainerMetrics()
    for name in STEP_GAUGES:
        value = metrics.registry.get_sample_value(f"rlfleet_trainer_{name}")
        assert value is not None and math.isnan(value), name
