"""The orchestrator's metrics: what they read before anything was counted, and as a run starts."""

from __future__ import annotations

import math

from rlfleet.v1.runs_pb2 import RunState
from rlfleet_rollout.metrics import RolloutMetrics

RUN_GAUGES = (
    "rlfleet_rollout_reward_mean",
    "rlfleet_rollout_eval_accuracy",
    "rlfleet_rollout_eval_pass_at_k",
    "rlfleet_rollout_eval_mean_length_tokens",
    "rlfleet_rollout_eval_truncation_rate",
    "rlfleet_rollout_step",
    "rlfleet_rollout_weight_version",
)


def test_runs_by_state_appear_at_the_first_count_of_the_store_not_at_0_before_it() -> None:
    """Scraped at 0 before the first count (Redis down as the orchestrator starts), then at the store's counts,
    the failed runs' series grew: RlfleetRunFailed fired for runs that had failed long before."""
    metrics = RolloutMetrics()
    assert metrics.registry.get_sample_value("rlfleet_rollout_runs", {"state": "failed"}) is None
    metrics.set_run_counts({RunState.RUN_STATE_FAILED: 2})
    assert metrics.registry.get_sample_value("rlfleet_rollout_runs", {"state": "failed"}) == 2
    assert metrics.registry.get_sample_value("rlfleet_rollout_runs", {"state": "queued"}) == 0


def test_a_runs_gauges_hold_no_value_until_it_has_one() -> None:
    """A 0 reward or accuracy from a fresh process reads as a collapse, and an earlier run's values pass for the
    run just started (a resumed run skips the evaluations it holds): NaN, "none", until the run sets them."""
    metrics = RolloutMetrics()
    for name in RUN_GAUGES:
        assert math.isnan(metrics.registry.get_sample_value(name) or 0.0), name
    metrics.reward_mean.set(0.75)
    metrics.eval_accuracy.set(0.5)
    metrics.step.set(12)
    metrics.start_run()
    for name in RUN_GAUGES:
        assert math.isnan(metrics.registry.get_sample_value(name) or 0.0), name


def test_the_step_gauge_says_it_counts_training_steps() -> None:
    """It is the trainer's step (one a rollout batch, several optimizer updates each), as rlfleet_trainer_step."""
    [family] = [f for f in RolloutMetrics().registry.collect() if f.name == "rlfleet_rollout_step"]
    assert family.documentation.startswith("Training steps (rollout batches)")
