"""Prometheus metrics of the trainer (own registry, exported on /metrics)."""

from __future__ import annotations

import math
from collections.abc import Callable

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlfleet_trainer.stream_lag import StreamLagCollector

# Step metrics exported as gauges `rlfleet_trainer_<name>`, from train_step's result.
STEP_GAUGES = {
    "loss": "policy loss of the last step",
    "pg_clipfrac": "fraction of trained tokens whose ratio was clipped",
    "pg_dual_clipfrac": "fraction of trained tokens whose loss the dual clip bounded (negative advantage)",
    "approx_kl": "estimated KL(rollout policy || updated policy) of the last step",
    "entropy": "mean per-token entropy of the policy on trained tokens",
    "kl": "mean KL estimate to the reference policy",
    "grad_norm": "gradient norm before clipping",
    "lr": "learning rate of the last step",
    "logprob_diff": "mean |trainer - rollout| log-prob of trained tokens",
    "reward_mean": "mean reward of the last step's scored samples (failed and aborted ones have none)",
    "tokens_per_second": "tokens processed per second in the last step",
    "value_loss": "value-head loss of the last step (ppo)",
    "tis_weight": "mean truncated importance-sampling weight of trained tokens",
    "ratio_masked_frac": "fraction of trained tokens left out for a train/rollout ratio outside the band",
    "pack_efficiency": "share of the packed micro-batches' token slots holding real tokens",
    "optimizer_updates": "optimizer updates the last step took (trainer.mini_batches x trainer.epochs)",
}


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """registry: where to register (rank 0 shares its RankGroup's); a new one by default."""
        self.registry = registry or CollectorRegistry()
        self.step = Gauge(
            "rlfleet_trainer_step", "training steps (rollout batches) taken in the active run", registry=self.registry
        )
        self.weight_version = Gauge(
            "rlfleet_trainer_weight_version", "weight version the fleet serves", registry=self.registry
        )
        self.step_seconds = Histogram(
            "rlfleet_trainer_step_seconds",
            "time of one training step (all its optimizer updates)",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 3600),
            registry=self.registry,
        )
        self.weight_sync_seconds = Histogram(
            "rlfleet_trainer_weight_sync_seconds",
            "time from training step end to the fleet serving the new version (distributed: the broadcast, and any "
            "wait for the previous version's disk copy; not the copy written in the background)",
            # Up to the weight load's bound (--weight-load-timeout-s, 300 s) and past it: a quantile can only
            # show values up to the largest finite bucket.
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        # weight_sync=distributed: the disk copy of each broadcast version, written beside the next step.
        self.weight_disk_copy_seconds = Histogram(
            "rlfleet_trainer_weight_disk_copy_seconds",
            "time to write a broadcast weight version's disk copy and register it with the router, in the background "
            "while the next step trains (not part of weight_sync_seconds)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )
        self.weight_disk_copy_wait_seconds = Histogram(
            "rlfleet_trainer_weight_disk_copy_wait_seconds",
            "time the training thread waited for the disk copy in flight (before the next publish, a checkpoint, "
            "the run's end): the part of the copy that the step did not hide",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )
        self.weight_disk_copy_in_flight = Gauge(
            "rlfleet_trainer_weight_disk_copy_in_flight",
            "1 while a broadcast weight version's disk copy is being written or registered, else 0",
            registry=self.registry,
        )
        self.weight_disk_copy_failures = Counter(
            "rlfleet_trainer_weight_disk_copy_failures_total",
            "disk copies of broadcast weight versions that failed (the run fails at its next publish, checkpoint or "
            "end)",
            registry=self.registry,
        )
        self.checkpoint_seconds = Histogram(
            "rlfleet_trainer_checkpoint_seconds",
            "time to write a checkpoint and commit it (record + acknowledgement of the groups it covers)",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.checkpoint_step = Gauge(
            "rlfleet_trainer_checkpoint_step", "step of the active run's last checkpoint", registry=self.registry
        )
        self.groups_consumed = Counter(
            "rlfleet_trainer_groups_consumed_total", "sample groups trained on", registry=self.registry
        )
        self.samples_consumed = Counter(
            "rlfleet_trainer_samples_consumed_total", "samples trained on", registry=self.registry
        )
        self.skipped_updates = Counter(
            "rlfleet_trainer_skipped_updates_total",
            "optimizer updates skipped because the gradient norm was not finite (the weights were kept)",
            registry=self.registry,
        )
        self.fleet_reloads = Counter(
            "rlfleet_trainer_fleet_reloads_total",
            "times the run's weight version was loaded again because the router reported another one or none "
            "(a restarted router)",
            registry=self.registry,
        )
        self.gauges = {
            name: Gauge(f"rlfleet_trainer_{name}", help_text, registry=self.registry)
            for name, help_text in STEP_GAUGES.items()
        }
        # None before a run's first step (NaN): a 0 loss, reward or learning rate reads as a value.
        self.observe_step({})

    def watch_stream_lag(self, client: redis.Redis, prefix: str, active: Callable[[], tuple[str, int] | None]) -> None:
        """Exports rlfleet_trainer_stream_lag_groups, read at each scrape for the run `active` names (stream_lag.py):
        `client` a scrape client, `active` the run being trained as (run id, groups trained), or None."""
        self.registry.register(StreamLagCollector(client, prefix, active))

    def start_run(self, step: int, weight_version: int, checkpoint_step: int) -> None:
        """Shows a run that starts: where it stands, and no step values yet (NaN) rather than the last run's."""
        self.step.set(step)
        self.weight_version.set(weight_version)
        self.checkpoint_step.set(checkpoint_step)
        self.observe_step({})

    def observe_step(self, metrics: dict[str, float]) -> None:
        """Sets the step gauges from a step's metrics. A gauge the step has no value for (a step with no sample to
        train on has no loss; a run without PPO no value loss) is NaN, "none", rather than an earlier step's value
        passed off as this one's."""
        for name, gauge in self.gauges.items():
            gauge.set(metrics.get(name, math.nan))
        if metrics.get("update_skipped"):
            self.skipped_updates.inc(metrics["update_skipped"])  # a step of several updates may skip more than one
        if "step_seconds" in metrics:
            self.step_seconds.observe(metrics["step_seconds"])
        if "weight_sync_seconds" in metrics:
            self.weight_sync_seconds.observe(metrics["weight_sync_seconds"])
