"""The run loop: one run from RUNNING to a final state, as a plain coroutine over a few objects.

    start the trainer (or resume: its Status says which step it is at)
    evaluate the initial weights (step 0)
    for step s from the trainer's step to schedule.steps:
        wait until the trainer serves weight version >= s - max_staleness (bounded; failing at once if the
        trainer set aside one of the run's groups, which leaves it a group short for good)
        (every eval_every steps: evaluate once the trainer serves version s)
        produce groups_per_step SampleGroups that pass the filters, from the step's saved data
        position on (step_producer), record where the step ended and what it filtered, append them
        to the stream, count the step in the run's progress
    wait until the trainer serves version schedule.steps, evaluate, wait (bounded) until the last step's
    report is in the run's record, StopRun, SUCCEEDED

Appending is idempotent per group id, so a restarted orchestrator re-producing a step never
duplicates a group. Cancellation arrives as asyncio cancellation: if the record says CANCELLED the
trainer is stopped, otherwise (the orchestrator is shutting down) the run stays RUNNING to be resumed.

A run that ends is recorded SUCCEEDED or FAILED first, then the trainer is stopped: the record is the
durable note of the stop owed (a restart makes it up, trainer_release.py), and nothing sees the run alive
while the stop is retried. Stopping the trainer is repeated until it lets go of the run (bounded); the
run's record then takes the trainer's final progress, which includes the step it finished after the
cancel, as best it can (a Redis error there is logged; the outcome is already recorded).

A Redis restart is waited out by the Redis clients' own retries (rlfleet.sample_stream); an outage
longer than their budget fails the run, and that final state is recorded once Redis answers again. Redis
refusing writes (full, read-only, unable to persist: redis_outage.py) fails nothing: it lasts until an operator
ends it, and the run is left RUNNING to the run queue, which resumes it from its records once Redis takes
writes again.

The run's record is written through a core fenced for its driver (run_fence.py): a write refused because the run is
not this driver's any more (its lease another's, its record gone or gone back in time) ends the driving with
FencedOut, recording nothing and stopping no trainer: the run is not this one's to end. The tasks beside the loop
(the step report follower, the watchdog) end before it does, so none of them writes the run after its driver.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import redis

from rlfleet.errors import Internal, InvalidInput, RlfleetError
from rlfleet.sample_stream import REDIS_RETRY_BUDGET_S, REDIS_RETRY_ERRORS, SampleStream, redis_refusal
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet.v1.trainer_pb2 import TrainerStatus
from rlfleet_rollout.concurrency import cancel_and_wait, log_task_failure, on_failure
from rlfleet_rollout.config import RolloutConfig
from rlfleet_rollout.environment import ReplyPool
from rlfleet_rollout.evaluation import evaluate
from rlfleet_rollout.group_filters import FilterRegistry, usable_rewards
from rlfleet_rollout.group_producer import RolloutContext
from rlfleet_rollout.metrics import FINAL_RECORD, RolloutMetrics
from rlfleet_rollout.model_directory import context_length
from rlfleet_rollout.prompt_tokenizer import load_chat_template, load_tokenizer
from rlfleet_rollout.redis_outage import until_redis_answers
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.router_client import RouterClient
from rlfleet_rollout.run_data import DataPosition, RunData, StepCounts
from rlfleet_rollout.run_events import is_terminal
from rlfleet_rollout.run_fence import FencedOut
from rlfleet_rollout.runs_core import RunEnded, RunsCore, now
from rlfleet_rollout.step_producer import StepOutcome, produce_step, refill_step, staleness
from rlfleet_rollout.step_reports import StepReportFollower
from rlfleet_rollout.step_watchdog import watch_progress
from rlfleet_rollout.trainer_client import TrainerClient
from rlfleet_rollout.trainer_release import TrainerRelease, trainer_progress
from rlfleet_rollout.trainer_session import TrainerSession

logger = logging.getLogger(__name__)
# What follows when a task beside the run loop fails (the loop itself meets what the run cannot go on without).
_GOES_ON = "; the run goes on without it"
# Bound on asking the router what context its engines serve, at a run's start (engines still loading answer 503).
SERVED_CONTEXT_TIMEOUT_S = 10.0


async def _context_tokens(router: RouterClient, model_path: str, run_id: str) -> int:
    """The context a run's generations must fit: the model's (config.json), or the engines' when they serve less
    (SGLang's --context-length), which refuse a prompt and max_new_tokens reaching it: every long sample failed.
    The model's alone, said in the log, when the router does not answer."""
    model = await asyncio.to_thread(context_length, model_path)
    try:
        served = await router.served_context_length(SERVED_CONTEXT_TIMEOUT_S)
    except RlfleetError as exc:
        logger.warning(
            "run %s: the router did not say what context its engines serve (%s); generations are fitted to the "
            "model's, %s",
            run_id,
            exc,
            model or "unknown",
            extra={"run_id": run_id},
        )
        return model
    if served and (not model or served < model):
        logger.info(
            "run %s: the engines serve a context of %d tokens, the model %s: generations are fitted to %d",
            run_id,
            served,
            model or "does not say",
            served,
            extra={"run_id": run_id},
        )
        return served
    return model


# Bound on the end of a task beside the run loop once it is cancelled (each of its waits is cancellable).
_HELPER_STOP_WITHIN_S = 10.0
# How long a finished run waits for the trainer's report of its last step (made as the trainer ends the step,
# before the final evaluation starts, so it is normally there at once) before it ends with the metrics it has.
LAST_REPORT_WAIT_S = 10.0


@dataclass(frozen=True)
class RunDeps:
    """The long-lived objects every run uses."""

    core: RunsCore
    trainer: TrainerClient
    router: RouterClient
    reward: RewardClient
    redis: redis.Redis
    config: RolloutConfig
    metrics: RolloutMetrics
    filters: FilterRegistry
    rollouts: RolloutRegistry
    replies: ReplyPool | None = None

    @property
    def release(self) -> TrainerRelease:
        return TrainerRelease(
            self.trainer, self.core, within_s=self.config.step_timeout_s, first_pause_s=self.config.poll_interval_s
        )


async def execute_run(run_id: str, deps: RunDeps) -> None:
    """Drives `run_id` to SUCCEEDED or FAILED; returns early if it is cancelled. Raises the Redis errors that leave
    it RUNNING, for the run queue to resume it: Redis refusing writes, or unavailable when the run starts."""
    log = {"run_id": run_id}
    try:
        run = await deps.core.update(run_id, _mark_running)
    except RunEnded:
        return
    deps.metrics.start_run()
    session = TrainerSession(
        deps.trainer,
        run_id,
        run.spec,
        step_timeout_s=deps.config.step_timeout_s,
        poll_interval_s=deps.config.poll_interval_s,
        on_status=lambda status: _record_trainer_status(deps, run_id, status),
        release=deps.release,
    )
    try:
        await _drive(run, session, deps)
    except asyncio.CancelledError:
        record = await deps.core.get(run_id)
        if record.state == RunState.RUN_STATE_CANCELLED:
            logger.info("run %s cancelled; stopping the trainer", run_id, extra=log)
            await session.stop()
        raise
    except RunEnded:
        await session.stop()
        return
    except FencedOut:
        raise  # the run is not this driver's: nothing of it failed, and its end is not this one's to record
    except Exception as exc:  # noqa: BLE001 - any fault ends the run as FAILED with its reason
        if redis_refusal(exc) is not None:
            raise  # nothing of the run failed: the queue resumes it once Redis takes writes
        if isinstance(exc, RlfleetError):
            reason = str(exc)
            logger.error("run %s failed: %s", run_id, reason, extra=log)
        elif isinstance(exc, REDIS_RETRY_ERRORS):
            reason = f"Redis was unreachable for longer than {REDIS_RETRY_BUDGET_S:.0f}s: {type(exc).__name__}: {exc}"
            logger.error("run %s failed: %s", run_id, reason, extra=log)
        else:
            reason = f"internal error: {type(exc).__name__}: {exc}"
            logger.exception("run %s failed", run_id, extra=log)
        await _end(deps, run_id, session, RunState.RUN_STATE_FAILED, reason)
        return
    await _end(deps, run_id, session, RunState.RUN_STATE_SUCCEEDED, "")


async def _end(deps: RunDeps, run_id: str, session: TrainerSession, state: RunState, error: str) -> None:
    """Records the run's final state, then stops its trainer. Cancelled meanwhile (a Cancel, which writes its own
    final state, or a shutdown), it still stops the trainer once the run's record says it ended: that stop was
    owed, and skipped, the trainer held an ended run."""
    try:
        await _record_final(deps, run_id, state, error)
    except asyncio.CancelledError:
        try:
            ended = is_terminal((await deps.core.get(run_id)).state)
        except Exception:  # noqa: BLE001 - not known now: the run queue frees a trainer an ended run holds at start
            ended = False
        if ended:
            await session.stop()
        raise
    await session.stop()


async def _record_final(deps: RunDeps, run_id: str, state: RunState, error: str) -> None:
    """Records the run's final state, waiting for Redis if it is down (the outcome must not be lost), before the
    trainer is stopped: the record is what says the stop is owed."""
    try:
        await until_redis_answers(
            lambda: deps.core.update(run_id, _mark_finished(state, error)), FINAL_RECORD, deps.metrics
        )
    except RunEnded:
        pass


async def _drive(run: Run, session: TrainerSession, deps: RunDeps) -> None:
    run_id, spec = run.id, run.spec
    position = DataPosition(deps.redis, run_id, prefix=deps.config.redis_prefix)
    data = await asyncio.to_thread(RunData.from_spec, spec, position)
    tokenizer = await asyncio.to_thread(load_tokenizer, spec.model.tokenizer_path)
    render: Callable[[str], str] = str
    if spec.dataset.chat_template:
        render = await asyncio.to_thread(load_chat_template, spec.model.tokenizer_path)
    await deps.core.update(run_id, _rows_skipped_setter(data.skipped_rows))
    ctx = RolloutContext(
        router=deps.router,
        reward=deps.reward,
        tokenizer=tokenizer,
        spec=spec,
        limit=asyncio.Semaphore(deps.config.max_concurrent_generations),
        episodes=asyncio.Semaphore(deps.config.max_episodes_under_way),
        metrics=deps.metrics,
        rollout=deps.rollouts.function(spec.rollout.function),
        render=render,
        environment=deps.rollouts.environment(spec.rollout.multi_turn.environment)
        if spec.rollout.HasField("multi_turn")
        else None,
        context_tokens=await _context_tokens(deps.router, spec.model.path, run_id),
        replies=deps.replies,
    )
    stream = SampleStream(deps.redis, run_id, prefix=deps.config.redis_prefix)
    await _check_same_dataset(data, position)
    steps, eval_every = spec.schedule.steps, spec.schedule.eval_every
    stream_complete = partial(_check_no_group_lost, stream)

    status = await session.start()
    first = min(int(status.step), steps)
    logger.info("run %s starts at step %d of %d", run_id, first, steps, extra={"run_id": run_id})
    reports = StepReportFollower(deps.trainer, deps.core, run_id, reconnect_after_s=deps.config.poll_interval_s * 5)
    follower = asyncio.create_task(reports.follow(), name=f"step reports of run {run_id}")
    on_failure(
        follower, partial(log_task_failure, logger, run_id, "copying the trainer's step reports", outcome=_GOES_ON)
    )
    watchdog = asyncio.create_task(
        watch_progress(deps.core, deps.metrics, run_id, deps.config.stall_after_s), name=f"watchdog of run {run_id}"
    )
    on_failure(watchdog, partial(log_task_failure, logger, run_id, "its step watchdog", outcome=_GOES_ON))
    try:
        if first == 0:
            await _evaluate_once(ctx, deps, data, run_id, 0, status)
        for step in range(first, steps):
            if step > 0 and eval_every > 0 and step % eval_every == 0:
                status = await session.wait_for_version(step, stream_complete)
                await _evaluate_once(ctx, deps, data, run_id, step, status)
            status = await session.wait_for_version(step - spec.rollout.max_staleness, stream_complete)
            await _produce_step(ctx, deps, data, stream, position, run_id, step, int(status.weight_version))
        status = await session.wait_for_version(steps, stream_complete)
        await _evaluate_once(ctx, deps, data, run_id, steps, status)
        if not await reports.caught_up(steps, LAST_REPORT_WAIT_S):
            logger.warning(
                "run %s: the trainer's report of step %d did not arrive within %.0fs; the run keeps step %d's metrics",
                run_id,
                steps,
                LAST_REPORT_WAIT_S,
                reports.step,
                extra={"run_id": run_id},
            )
    finally:
        # Ended, not only cancelled: one running on would write the run's record after its driver stopped.
        for helper in (follower, watchdog):
            if not await cancel_and_wait(helper, within_s=_HELPER_STOP_WITHIN_S):
                logger.error(
                    "run %s: %s did not end within %.0fs of its cancellation",
                    run_id,
                    helper.get_name(),
                    _HELPER_STOP_WITHIN_S,
                    extra={"run_id": run_id},
                )


async def _check_same_dataset(data: RunData, position: DataPosition) -> None:
    """InvalidInput when the dataset's rows differ from those the run started on (a file edited or replaced
    while the run was stopped): its saved positions would name other prompts, and held-out ones be trained."""
    current = await asyncio.to_thread(data.fingerprint)
    recorded = await asyncio.to_thread(position.pin_dataset, current)
    if recorded != current:
        raise InvalidInput(
            f"dataset: the rows differ from those the run started on (fingerprint {current}, recorded "
            f"{recorded}): the file changed while the run was stopped; restore it, or submit a new run"
        )


async def _check_no_group_lost(stream: SampleStream) -> None:
    """Internal when the trainer set aside one of the run's groups (untrainable, or deleted from the stream
    while pending): every step takes exactly groups_per_step groups, so the run could never finish."""
    lost = await asyncio.to_thread(stream.lost_groups)
    if lost:
        entry_id, reason = lost[0]
        raise Internal(
            f"the trainer set aside {len(lost)} of the run's groups (stream entry {entry_id}: {reason}); without "
            f"them the run cannot complete its steps (the entries are kept in {stream.dead_key})"
        )


async def _produce_step(
    ctx: RolloutContext,
    deps: RunDeps,
    data: RunData,
    stream: SampleStream,
    position: DataPosition,
    run_id: str,
    step: int,
    version: int,
) -> None:
    try:
        start = await asyncio.to_thread(position.start_of, step)
    except LookupError as exc:
        raise Internal(f"step {step}: the data position of the run is missing from Redis ({exc})") from exc
    slots = await asyncio.to_thread(position.slots_of, step)
    outcome: StepOutcome | None = None
    first_time = False
    if slots is None:
        outcome = await produce_step(ctx, data, deps.filters, run_id, step, start, version)
        # Recorded before the groups go out: a re-produced step then starts the next one at the same place,
        # and fills its slots with the same prompts.
        counts = StepCounts(dict(outcome.filtered), outcome.downweighted, sum(outcome.rewards), len(outcome.rewards))
        first_time = await asyncio.to_thread(position.record_end, step, outcome.end, outcome.slots, counts)
        if not first_time:  # another producer recorded the step first: its prompts are the step's
            slots = await asyncio.to_thread(position.slots_of, step)
    if first_time or slots is None:
        assert outcome is not None  # ours, or (a record written before slots were recorded) as it was then
        groups = outcome.groups
    else:
        held = await asyncio.to_thread(stream.holds, [f"{run_id}/{step}/{i}" for i in range(len(slots))])
        missing = [i for i, there in enumerate(held) if not there]
        have = dict(zip(outcome.slots, outcome.groups, strict=True)) if outcome is not None else {}
        groups = await refill_step(ctx, data, run_id, step, slots, missing, version, have)
        logger.info(
            "run %s step %d was produced before: %d of its %d groups were missing from the stream",
            run_id,
            step,
            len(missing),
            len(slots),
            extra={"run_id": run_id, "step": step},
        )
    for group in groups:
        if await asyncio.to_thread(stream.append, group) is not None:
            deps.metrics.groups_produced.inc()
            deps.metrics.group_staleness.observe(staleness(group, step))
    # Over every sample generated for the step, filtered groups' too: zero_variance drops the groups all right and
    # all wrong, and the trained ones alone would stay near the middle however the policy does. Failed and aborted
    # samples have no reward (0 on the wire): counted, an engine fault would read as a worse policy. A step
    # produced before (a restart) has the mean its producer recorded, not that of the few groups refilled now.
    ours = outcome if first_time else None  # the step as this orchestrator produced it
    recorded = None if ours is not None else (await asyncio.to_thread(position.counts_of, range(step, step + 1)))[step]
    if recorded is not None and recorded.rewards:
        reward_sum, rewards = recorded.reward_sum, recorded.rewards
    else:
        usable = ours.rewards if ours is not None else [r for g in groups for r in usable_rewards(g)]
        reward_sum, rewards = sum(usable), len(usable)
    mean_reward = reward_sum / rewards if rewards else 0.0
    if rewards:
        deps.metrics.reward_mean.set(mean_reward)
    if ours is not None:
        for reason, count in ours.filtered.items():
            deps.metrics.groups_filtered.labels(reason=reason).inc(count)
    gps = ctx.spec.rollout.groups_per_step
    filtered = await _record_progress(deps, data, position, run_id, step, gps, mean_reward if rewards else None)
    logger.info(
        "run %s step %d: %d groups on the stream (%d filtered), mean reward %.3f",
        run_id,
        step,
        len(groups),
        filtered,
        mean_reward,
        extra={"run_id": run_id, "step": step},
    )


async def _record_progress(
    deps: RunDeps,
    data: RunData,
    position: DataPosition,
    run_id: str,
    step: int,
    groups_per_step: int,
    mean_reward: float | None,
) -> int:
    """Records step `step` in the run's progress; returns how many groups the step filtered.

    The filtered and down-weighted groups of a step are counted from its data-position record, written once by
    its producer, for every step up to `step` that the progress has not counted yet: this one, and any whose
    producer died before it recorded its progress. Which steps are counted the progress itself says: each adds
    groups_per_step to groups_produced, which only grows. So each step is counted once, however often the write is
    applied (again on the record another writer left, by the compare-and-set) and whichever orchestrator makes it.
    """
    counted = (await deps.core.get(run_id)).progress.groups_produced // groups_per_step
    counts = await asyncio.to_thread(position.counts_of, range(min(counted, step), step + 1))
    end = await asyncio.to_thread(position.start_of, step + 1)

    def record(run: Run) -> None:
        progress = run.progress
        # Steps from `counted` on, as groups_produced has only grown since it was read.
        for uncounted in range(progress.groups_produced // groups_per_step, step + 1):
            tally = counts[uncounted]
            progress.groups_filtered += sum(tally.filtered.values())
            for reason, count in tally.filtered.items():
                progress.filtered_by_reason[reason] += count
            progress.groups_downweighted += tally.downweighted
        progress.groups_produced = max(progress.groups_produced, (step + 1) * groups_per_step)
        if mean_reward is not None:
            progress.mean_reward = mean_reward
        progress.prompts_consumed = max(progress.prompts_consumed, end)
        progress.epoch = max(progress.epoch, data.epoch_of(max(0, end - 1)))

    await deps.core.update(run_id, record)
    return sum(counts[step].filtered.values())


async def _evaluate_once(
    ctx: RolloutContext, deps: RunDeps, data: RunData, run_id: str, step: int, status: TrainerStatus
) -> None:
    """Evaluates at `step` unless the run already holds that evaluation (it was resumed)."""
    run = await deps.core.get(run_id)
    if any(ev.step == step for ev in run.evals):
        return
    result = await evaluate(
        ctx, run_id, step, data.eval_prompts, deps.config.eval_batch_size, int(status.weight_version)
    )
    deps.metrics.eval_accuracy.set(result.accuracy)
    deps.metrics.eval_pass_at_k.set(result.pass_at_k)
    deps.metrics.eval_mean_length.set(result.mean_length)
    deps.metrics.eval_truncation_rate.set(result.truncation_rate)
    logger.info("run %s eval at step %d: accuracy %.3f", run_id, step, result.accuracy, extra={"run_id": run_id})

    def record(run: Run) -> None:
        if not any(ev.step == step for ev in run.evals):
            run.evals.append(result)

    await deps.core.update(run_id, record)


async def _record_trainer_status(deps: RunDeps, run_id: str, status: TrainerStatus) -> None:
    deps.metrics.step.set(status.step)
    deps.metrics.weight_version.set(status.weight_version)
    await deps.core.update(run_id, trainer_progress(status))


def _rows_skipped_setter(count: int) -> Callable[[Run], None]:
    def record(run: Run) -> None:
        run.progress.rows_skipped = count

    return record


def _mark_running(run: Run) -> None:
    run.state = RunState.RUN_STATE_RUNNING
    if not run.HasField("started_at"):
        run.started_at.CopyFrom(now())


def _mark_finished(state: RunState, error: str) -> Callable[[Run], None]:
    def record(run: Run) -> None:
        run.state = state
        run.error = error
        run.stalled = ""
        run.finished_at.CopyFrom(now())

    return record
