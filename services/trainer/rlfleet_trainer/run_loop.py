"""The training loop of one run, as a plain function over the objects that hold state.

Per step: collect `groups_per_step` groups from the stream (entries a dead consumer left, claimed once idle, of
which those older than the last one taken come first; then this consumer's pending entries in id order after the
last one taken; then new ones), take one step of
the run's algorithm, write the weights as version step + 1 and make the fleet serve them. A step
acknowledges nothing: a checkpoint does (checkpoint_commit.py), every `trainer.checkpoint_every`
steps, at the schedule's end, at a stop that asks for one, and when a Checkpoint call asks. The
step's version is reported after its checkpoint, so whoever waits for version v (the orchestrator)
finds the engines serving it and, at the end, the final checkpoint committed. While it waits for
groups, the loop keeps the fleet on the run's version (fleet_version.py).

With weight_sync=distributed a version's disk copy is written while the next step trains
(weight_publisher.py). A checkpoint and the run's end wait for it first (bounded), so a checkpoint never
acknowledges groups whose version has no copy for engines that rejoin, and a run that stops leaves its
last version registered; a copy that failed fails the run there, or at the next publish, as it did when it
was written on the step path. Status names only a complete directory (`ActiveRun.weights_path`): while a copy
is under way, the version before, which pruning keeps meanwhile. Nor is the fleet's version checked then: the
copy's own registration brings a restarted router back to the version.

Resumed from a checkpoint, the loop reads its pending entries again in id order with the same
partition into steps, so it retrains exactly the groups after the checkpoint, in the same steps.
It publishes versions it had published before the crash again, deliberately: version v always names
the policy after step v, and retraining step v from the restored state reproduces that policy, so
samples labelled v before the crash still say which policy produced them and the orchestrator's
`version = step` staleness arithmetic holds. The router and the engines (SGLang's weight_version is
a label) accept any version, including one they have seen before.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from rlfleet.sample_stream import SampleStream, StreamEntry, entry_order
from rlfleet.v1.trainer_pb2 import StepReport, TrainerState
from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.checkpoint_commit import CheckpointCommitter
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.fleet_version import FleetVersionCheck
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.rank_group import RankGroup
from rlfleet_trainer.rank_ops import Policy
from rlfleet_trainer.redis_wait import waiting_out_redis
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_publisher import WeightPublisher, make_publisher
from rlfleet_trainer.weights import prune_versions

logger = logging.getLogger(__name__)
# Entries claimed from other consumers per round trip.
CLAIM_BATCH = 1000


class Checkpoints(Protocol):
    def commit(self, run: ActiveRun, step: int, groups_trained: int) -> None:
        """Checkpoints `run` as of `step` (see `CheckpointCommitter.commit`)."""
        ...


@dataclass(frozen=True)
class AfterPublished:
    """Checkpoints taken once what the publisher left under way (a version's disk copy) is done: a checkpoint of
    step v acknowledges v's groups only once v is on disk for engines that rejoin, and not if its copy failed."""

    checkpoints: Checkpoints
    publisher: WeightPublisher

    def commit(self, run: ActiveRun, step: int, groups_trained: int) -> None:
        self.publisher.settle()
        self.checkpoints.commit(run, step, groups_trained)


def collect_groups(
    run: ActiveRun,
    settings: TrainerSettings,
    needed: int,
    checkpoints: Checkpoints,
    while_waiting: Callable[[ActiveRun], None] = lambda _run: None,
) -> list[StreamEntry]:
    """Blocks (in bounded waits, watching `run.stop`) until `needed` groups are delivered; takes a
    checkpoint asked for meanwhile (the model is at a step boundary while it waits) and calls
    `while_waiting` between waits (the fleet's version check)."""
    stream: SampleStream = run.stream
    consumer = settings.consumer
    entries: list[StreamEntry] = []
    own_taken = False  # whether the groups already pending on this consumer were taken
    waited = False
    while len(entries) < needed and not run.stop.is_set():
        if waited:
            if run.checkpoint_wanted:
                checkpoints.commit(run, run.step, run.groups_trained)
            while_waiting(run)
        waited = True
        elsewhere = waiting_out_redis(run, partial(stream.pending_elsewhere, consumer))
        if elsewhere is None:  # told to stop while Redis was away
            break
        if elsewhere:
            # Another consumer (a dead one, or this trainer under an earlier name) holds groups, which may be older
            # than this one's own: all are claimed, once idle enough, before any is taken, so each step is made of
            # the run's pending groups in id order whoever held them, the steps it was made of before the restart.
            claimed = waiting_out_redis(run, partial(stream.claim_stale, consumer, settings.claim_idle_ms, CLAIM_BATCH))
            if claimed:
                run.claimed_behind = _behind_cursor(run, claimed, entries)
            else:
                run.stop.wait(settings.read_block_ms / 1000)
            continue
        if run.claimed_behind:
            taken = run.claimed_behind[: needed - len(entries)]
            del run.claimed_behind[: len(taken)]
            entries += taken
            continue
        if not own_taken:
            own = partial(stream.read_own_pending, consumer, needed - len(entries), after=run.cursor)
            entries += waiting_out_redis(run, own) or []
            own_taken = True
            if entries:
                logger.info("run %s: %d group(s) were delivered before", run.run_id, len(entries))
            continue
        read = partial(stream.read, consumer, needed - len(entries), settings.read_block_ms)
        entries += waiting_out_redis(run, read) or []
        # After each read, returned or not: one whose reply was lost may have been the last before the stream went
        # quiet, and the entries taken in its place may fall short (one of them dead-lettered), so reading goes on.
        undelivered = partial(_with_undelivered_replies, stream, consumer, run.cursor, entries, needed)
        whole = waiting_out_redis(run, undelivered)
        entries = entries if whole is None else whole
    # Every entry taken is now pending on this consumer; the next step reads its pending ones after
    # them. (When own pending ones ran short, all of them were taken, and new ones come after all.)
    run.cursor = max([run.cursor, *(e.entry_id for e in entries)], key=entry_order)
    return entries


def _behind_cursor(run: ActiveRun, claimed: list[StreamEntry], entries: list[StreamEntry]) -> list[StreamEntry]:
    """`run.claimed_behind` with the `claimed` entries added that the cursor has passed and that the run has neither
    trained nor taken, in id order. Another consumer reading the stream beside this trainer held them while this one
    read newer entries: read after the cursor, they would wait for a restart, and hold back the trimming of the stream.
    Those the run trained itself and got back (another consumer claimed them while they awaited their checkpoint)
    are not taken again: the next checkpoint acknowledges them where they are."""
    cursor = entry_order(run.cursor)
    known = {*run.uncommitted, *(e.entry_id for e in entries), *(e.entry_id for e in run.claimed_behind)}
    behind = [e for e in claimed if entry_order(e.entry_id) <= cursor and e.entry_id not in known]
    return sorted([*run.claimed_behind, *behind], key=lambda e: entry_order(e.entry_id))


def _with_undelivered_replies(
    stream: SampleStream, consumer: str, cursor: str, entries: list[StreamEntry], needed: int
) -> list[StreamEntry]:
    """`entries`, or, when Redis handed this consumer entries whose reply never arrived (a read retried
    after a lost connection: the entries are pending here but were never seen), the pending ones in id
    order instead, so none is skipped by the cursor and left unacknowledged until a restart."""
    after = [e for e in entries if entry_order(e.entry_id) > entry_order(cursor)]
    # Up to the last entry taken: own pending ones past it were not asked for yet (a step takes `needed`).
    last = max((e.entry_id for e in after), key=entry_order) if after else "+"
    pending = stream.own_pending_between(consumer, cursor, last, len(after) + 1)
    if pending <= len(after):
        return entries
    logger.warning(
        "stream entries reached this trainer without their reply (a read was retried); taking its pending ones in order"
    )
    before = [e for e in entries if entry_order(e.entry_id) <= entry_order(cursor)]  # claimed from a dead consumer
    return before + stream.read_own_pending(consumer, needed - len(before), after=cursor)


def checkpoint_due(run: ActiveRun, step: int) -> bool:
    every = run.spec.trainer.checkpoint_every
    return step >= run.spec.schedule.steps or (every > 0 and step % every == 0) or run.checkpoint_wanted


def train_run(
    run: ActiveRun,
    settings: TrainerSettings,
    router: RouterClient,
    checkpoints: CheckpointCommitter,
    metrics: TrainerMetrics,
) -> None:
    """Trains until the schedule's last step or until `run.stop` is set; records failures on `run`."""
    publisher = make_publisher(
        settings,
        router,
        run.weights_root,
        run.tokenizer_dir,
        lambda _model: run.ranks.call("full_state_dict"),
        abort_all_requests=run.spec.rollout.on_weight_update == "abort_resume",
        base_model=Path(run.spec.model.path),
        metrics=metrics,
        on_written=run.weights_written,
    )
    check_fleet = FleetVersionCheck(router, settings.fleet_check_s, metrics)
    commits = AfterPublished(checkpoints, publisher)
    try:
        total_steps = run.spec.schedule.steps
        needed = run.spec.rollout.groups_per_step
        while run.step < total_steps and not run.stop.is_set():
            entries = collect_groups(run, settings, needed, commits, check_fleet)
            if len(entries) < needed:  # stopped while waiting: nothing else ends the wait short
                break
            groups = [e.group for e in entries]
            version = run.step + 1
            step_metrics = run.ranks.call("train_step", groups, version)
            sync_started = time.perf_counter()
            publisher.publish(run.model, version)
            step_metrics["weight_sync_seconds"] = time.perf_counter() - sync_started
            run.uncommitted.extend(e.entry_id for e in entries)
            groups_trained = run.groups_trained + len(groups)
            if checkpoint_due(run, version):
                commits.commit(run, version, groups_trained)
            report(run, version, len(groups), groups_trained, step_metrics, metrics)
            # Never the directory Status names (the version before this one while its copy is written).
            keep_from = min(version - settings.keep_weight_versions + 1, run.weights_version)
            prune_versions(run.weights_root, keep_from=keep_from)
        if run.checkpoint_on_stop or run.checkpoint_wanted:
            commits.commit(run, run.step, run.groups_trained)
        publisher.settle()  # the last version's copy is on disk (and registered) before the run reports its end
        run.update(state=TrainerState.TRAINER_STATE_STOPPED)
    except Exception as exc:  # noqa: BLE001 - the run fails with a reason instead of the thread dying silently
        logger.exception("run %s failed at step %d", run.run_id, run.step, extra={"run_id": run.run_id})
        run.update(state=TrainerState.TRAINER_STATE_FAILED, error=f"{type(exc).__name__}: {exc}")
    finally:
        # No step values while no run trains: the last step's tokens per second, loss, ... read as live otherwise.
        metrics.observe_step({})
        # The run reports its end above, before this: TrainerCore starts no other run while this thread lives
        # (closing a distributed weight sync asks the router, which can take minutes).
        try:
            publisher.close()
        except Exception:  # noqa: BLE001 - the run has ended; its policy is released all the same
            logger.exception("run %s: closing its weight sync failed", run.run_id, extra={"run_id": run.run_id})
        release_policy(run.ranks, run.run_id, run.policy)


def release_policy(ranks: RankGroup, run_id: str, policy: Policy | None = None) -> None:
    """Frees run `run_id`'s model and optimizer on every rank; the run's state lives on in its checkpoints.

    `policy`: the one load_run gave the run. When rank 0 holds another one by now (a later run's), nothing is
    unloaded. Without it (a start that failed before load_run answered), whatever the ranks hold goes: only
    that start can have loaded it. The ranks follow rank 0, so rank 0's policy says what every rank holds."""
    if policy is not None and getattr(ranks.state, "policy", None) is not policy:
        logger.warning("run %s: the ranks hold another run's policy by now; it stays loaded", run_id)
        return
    try:
        ranks.call("unload_run")
    except Exception:  # noqa: BLE001 - a rank that failed is reported by the run's error already
        logger.exception("run %s: releasing the policy on the ranks failed", run_id)


def report(
    run: ActiveRun,
    version: int,
    groups: int,
    groups_trained: int,
    step_metrics: dict[str, float],
    metrics: TrainerMetrics,
) -> None:
    """Step `version` is done: Status and WatchSteps show it at once (a Status at that version has its report)."""
    now = Timestamp()
    now.GetCurrentTime()
    run.complete_step(
        StepReport(
            run_id=run.run_id, step=version, weight_version=version, metrics=step_metrics, groups=groups, time=now
        ),
        step=version,
        weight_version=version,
        groups_trained=groups_trained,
        state=TrainerState.TRAINER_STATE_TRAINING,
    )
    metrics.observe_step(step_metrics)
    metrics.step.set(version)
    metrics.weight_version.set(version)
    metrics.groups_consumed.inc(groups)
    metrics.samples_consumed.inc(step_metrics.get("samples", 0))
    logger.info(
        "run %s step %d/%d: loss %.4f reward %.3f logprob_diff %.2e (%.2fs + sync %.2fs)",
        run.run_id,
        version,
        run.spec.schedule.steps,
        step_metrics.get("loss", math.nan),  # none when the step had no sample to train on
        step_metrics.get("reward_mean", math.nan),
        step_metrics.get("logprob_diff", 0.0),
        step_metrics.get("step_seconds", 0.0),
        step_metrics["weight_sync_seconds"],
        extra={"run_id": run.run_id, "step": version},
    )
