"""The orchestrator's Prometheus metrics, on a registry of its own (one per app, never the global one)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlfleet.v1.runs_pb2 import RunState
from rlfleet.v1.samples_pb2 import SampleStatus

RUN_QUEUE, FINAL_RECORD = "run queue", "final run record"
REDIS_WAITERS = (RUN_QUEUE, FINAL_RECORD)
"""What waits out a Redis outage (`until_redis_answers`), the values of rlfleet_rollout_redis_outage_waits' label."""


class RolloutMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.runs = Gauge(
            "rlfleet_rollout_runs",
            "Runs by state, as the run store holds them (counted again every few seconds).",
            ["state"],
            registry=self.registry,
        )
        self.groups_produced = Counter(
            "rlfleet_rollout_groups_produced", "SampleGroups appended to run streams.", registry=self.registry
        )
        self.samples = Counter(
            "rlfleet_rollout_samples", "Samples produced, by status.", ["status"], registry=self.registry
        )
        self.generate_seconds = Histogram(
            "rlfleet_rollout_generate_seconds",
            "Latency of one /generate request (one prompt's group, or one evaluation batch).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.reward_mean = Gauge(
            "rlfleet_rollout_reward_mean",
            "Mean reward of the samples generated and scored for the last step, filtered groups' included "
            "(failed and aborted ones have none).",
            registry=self.registry,
        )
        self.eval_accuracy = Gauge(
            "rlfleet_rollout_eval_accuracy", "Held-out accuracy of the latest evaluation.", registry=self.registry
        )
        self.weight_version = Gauge(
            "rlfleet_rollout_weight_version", "Weight version the trainer published last.", registry=self.registry
        )
        self.resumed_generations = Counter(
            "rlfleet_rollout_resumed_generations",
            "Aborted generations re-submitted as prompt + partial response (rollout.on_weight_update abort_resume).",
            registry=self.registry,
        )
        self.groups_filtered = Counter(
            "rlfleet_rollout_groups_filtered",
            "Groups produced but kept from the trainer, by reason (a filter's name, stale, surplus, prompt_too_long).",
            ["reason"],
            registry=self.registry,
        )
        self.eval_pass_at_k = Gauge(
            "rlfleet_rollout_eval_pass_at_k",
            "Held-out share of prompts with a correct sample among k, latest evaluation.",
            registry=self.registry,
        )
        self.eval_mean_length = Gauge(
            "rlfleet_rollout_eval_mean_length_tokens",
            "Mean response length in tokens of the latest evaluation.",
            registry=self.registry,
        )
        self.eval_truncation_rate = Gauge(
            "rlfleet_rollout_eval_truncation_rate",
            "Share of the latest evaluation's responses cut at max_new_tokens.",
            registry=self.registry,
        )
        self.step = Gauge(
            "rlfleet_rollout_step",
            "Training steps (rollout batches) the trainer has taken in the run being driven.",
            registry=self.registry,
        )
        self.group_staleness = Histogram(
            "rlfleet_rollout_group_staleness",
            "Weight versions the oldest sample of each group appended to a run's stream lags behind the step it is "
            "trained in (0: on-policy; at most rollout.max_staleness, unless stale_groups down-weights it).",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
            registry=self.registry,
        )
        self.step_stalls = Counter(
            "rlfleet_rollout_step_stalls",
            "Times the running run made no progress for stall_after_s (the step watchdog's reports).",
            registry=self.registry,
        )
        self.redis_outage_waits = Counter(
            "rlfleet_rollout_redis_outage_waits",
            "Times Redis stayed unreachable beyond its client's retries, or refused writes (full, read-only, unable "
            "to persist), and the orchestrator waited for it (run queue, a run's final record), by what waited.",
            ["waiter"],
            registry=self.registry,
        )
        for waiter in REDIS_WAITERS:  # at 0 from the start: a first wait shows in rate() and increase()
            self.redis_outage_waits.labels(waiter=waiter)
        self.seconds_without_progress = Gauge(
            "rlfleet_rollout_seconds_without_progress",
            "Seconds since the running run last made progress (0 when it just moved or none runs).",
            registry=self.registry,
        )
        self.episode_turns = Histogram(
            "rlfleet_rollout_episode_turns",
            "Model turns of one multi_turn sample (1: it answered without the environment).",
            buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64),
            registry=self.registry,
        )
        # The runs-by-state series appear at the first count of the store (set_run_counts), not at 0 before it:
        # a 0 scraped before then (Redis down at start) is a drop of every state that rlfleet_rollout_runs'
        # readers (RlfleetRunFailed's delta) take for runs that changed state.
        self.start_run()
        for status in SampleStatus.keys():
            if status != "SAMPLE_STATUS_UNSPECIFIED":
                self.samples.labels(status=status.removeprefix("SAMPLE_STATUS_").lower())

    def start_run(self) -> None:
        """No value for the run being driven until it has one (NaN, "none"): a 0 reads as a collapsed reward or
        accuracy, and an earlier run's value passes for this one's (a resumed run skips the evaluations it
        holds, so the eval gauges would show another run's until its next one)."""
        for gauge in (
            self.reward_mean,
            self.eval_accuracy,
            self.eval_pass_at_k,
            self.eval_mean_length,
            self.eval_truncation_rate,
            self.step,
            self.weight_version,
        ):
            gauge.set(math.nan)

    def set_run_counts(self, counts: Mapping[RunState, int]) -> None:
        """Sets the runs-by-state gauge to `counts` (the store's, run_counts.py); a state it leaves out holds none."""
        for state in RunState.values():
            if state != RunState.RUN_STATE_UNSPECIFIED:
                self.runs.labels(state=_label(RunState.Name(state))).set(counts.get(state, 0))

    def add_filter_reasons(self, reasons: Iterable[str]) -> None:
        """Creates every reason's series at 0: a counter series that appears only at its first increment hides
        that increment from rate() and increase(), so a first filtered group would never show."""
        for reason in reasons:
            self.groups_filtered.labels(reason=reason)

    def count_sample(self, status: SampleStatus) -> None:
        self.samples.labels(status=SampleStatus.Name(status).removeprefix("SAMPLE_STATUS_").lower()).inc()


def _label(state_name: str) -> str:
    return state_name.removeprefix("RUN_STATE_").lower()
