"""The training loop of one run, as a plain function over the objects that hold state.

Per step: collect `groups_per_step` groups from the stream (own pending first, then groups a dead
consumer left, then new ones), take one step of the run's algorithm, write the weights as version
step + 1, make the fleet serve them, then record the step and acknowledge its groups in one
transaction. Only then is the new version reported, so whoever waits for version v (the
orchestrator) finds the engines serving it.
"""

from __future__ import annotations

import logging
import time

from google.protobuf.timestamp_pb2 import Timestamp

from rlfleet.sample_stream import SampleStream, StreamEntry
from rlfleet.v1.trainer_pb2 import StepReport, TrainerState
from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.run_state import RunRecord, RunStateStore
from rlfleet_trainer.train_step import StepConfig, step_config_from_spec, train_step
from rlfleet_trainer.weights import prune_versions, save_version

logger = logging.getLogger(__name__)


def collect_groups(run: ActiveRun, settings: TrainerSettings, needed: int) -> list[StreamEntry]:
    """Blocks (in bounded waits, watching `run.stop`) until `needed` groups are delivered."""
    stream: SampleStream = run.stream
    entries = stream.read_own_pending(settings.consumer, needed)
    if len(entries) < needed:
        entries += stream.claim_stale(settings.consumer, settings.claim_idle_ms, needed - len(entries))
    if entries:
        logger.info("run %s: resuming with %d group(s) delivered before", run.run_id, len(entries))
    while len(entries) < needed and not run.stop.is_set():
        entries += stream.read(settings.consumer, needed - len(entries), block_ms=settings.read_block_ms)
    return entries


def step_config(run: ActiveRun) -> StepConfig:
    return step_config_from_spec(run.spec, run.model, run.pad_id)


def train_run(
    run: ActiveRun,
    settings: TrainerSettings,
    router: RouterClient,
    store: RunStateStore,
    metrics: TrainerMetrics,
) -> None:
    """Trains until the schedule's last step or until `run.stop` is set; records failures on `run`."""
    try:
        config = step_config(run)
        total_steps = run.spec.schedule.steps
        needed = run.spec.rollout.groups_per_step
        while run.step < total_steps and not run.stop.is_set():
            entries = collect_groups(run, settings, needed)
            if len(entries) < needed:  # stopped while waiting
                break
            groups = [e.group for e in entries]
            step_metrics = train_step(run.model, run.optimizer, run.scheduler, groups, config, run.ref_model)
            version = run.step + 1
            sync_started = time.perf_counter()
            path = save_version(run.model, run.weights_root, version, run.tokenizer_dir)
            router.load_weights(str(path), version)
            step_metrics["weight_sync_seconds"] = time.perf_counter() - sync_started
            record = RunRecord(
                step=version,
                weight_version=version,
                weights_path=str(path),
                groups_trained=run.groups_trained + len(groups),
            )
            store.commit(run.run_id, record, run.stream, [e.entry_id for e in entries])
            prune_versions(run.weights_root, keep_from=version - settings.keep_weight_versions + 1)
            run.update(
                step=record.step,
                weight_version=record.weight_version,
                weights_path=record.weights_path,
                groups_trained=record.groups_trained,
                state=TrainerState.TRAINER_STATE_TRAINING,
            )
            now = Timestamp()
            now.GetCurrentTime()
            run.add_report(
                StepReport(
                    run_id=run.run_id,
                    step=version,
                    weight_version=version,
                    metrics=step_metrics,
                    groups=len(groups),
                    time=now,
                )
            )
            metrics.observe_step(step_metrics)
            metrics.step.set(version)
            metrics.weight_version.set(version)
            metrics.groups_consumed.inc(len(groups))
            metrics.samples_consumed.inc(step_metrics.get("samples", 0))
            metrics.stream_lag.set(max(0, run.stream.length() - record.groups_trained))
            logger.info(
                "run %s step %d/%d: loss %.4f reward %.3f logprob_diff %.2e (%.2fs + sync %.2fs)",
                run.run_id, version, total_steps, step_metrics.get("loss", 0.0), step_metrics["reward_mean"],
                step_metrics.get("logprob_diff", 0.0), step_metrics.get("step_seconds", 0.0),
                step_metrics["weight_sync_seconds"],
                extra={"run_id": run.run_id, "step": version},
            )
        run.update(state=TrainerState.TRAINER_STATE_STOPPED)
    except Exception as exc:  # noqa: BLE001 - the run fails with a reason instead of the thread dying silently
        logger.exception("run %s failed at step %d", run.run_id, run.step, extra={"run_id": run.run_id})
        run.update(state=TrainerState.TRAINER_STATE_FAILED, error=f"{type(exc).__name__}: {exc}")
