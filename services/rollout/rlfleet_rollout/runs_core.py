"""The Runs API without a transport: Submit, Get, List, Cancel and Watch over the run store.

The REST app and the gRPC servicer are thin layers over this object; the run loop writes progress
through `update`, the same path Cancel takes, so a cancelled run cannot be overwritten by a loop
that has not noticed yet.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from google.protobuf.timestamp_pb2 import Timestamp

from rlfleet.errors import Conflict, DeadlineExceeded, InvalidInput, Unavailable
from rlfleet.run_spec import resolve, validate
from rlfleet.v1.runs_pb2 import ListRunsResponse, Run, RunEvent, RunProgress, RunSpec, RunState
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.model_directory import require_model_config
from rlfleet_rollout.prompt_tokenizer import load_chat_template, tokenizer_file
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_data import RunData
from rlfleet_rollout.run_events import RunNotifier, describe_change, is_terminal, state_name
from rlfleet_rollout.run_store import RunStore

logger = logging.getLogger(__name__)


class RunEnded(Conflict):
    """The run reached a final state (e.g. it was cancelled) while someone still meant to change it."""


def now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


class RunsCore:
    def __init__(
        self,
        store: RunStore,
        reward: RewardClient,
        notifier: RunNotifier,
        metrics: RolloutMetrics,
        *,
        filters: FilterRegistry,
        rollouts: RolloutRegistry,
        poll_interval_s: float,
        run_data_retention_s: float,
    ) -> None:
        self.filters = filters
        self.rollouts = rollouts
        self.store = store
        self.reward = reward
        self.notifier = notifier
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.run_data_retention_s = run_data_retention_s
        self._lock = asyncio.Lock()
        self._closing = False

    async def count_existing_runs(self) -> None:
        """Fills the runs-by-state gauge from the store (once, at start-up)."""
        for run in await self.store.all_in_order(list(RunState.values())):
            self.metrics.count_run_state(None, run.state)

    # -- the API ------------------------------------------------------------------------------

    async def submit(self, spec: RunSpec, *, validate_only: bool = False) -> Run:
        """Resolves and validates `spec` in full, then stores the run QUEUED; nothing is stored if it is bad.

        `validate_only` (AIP-163) makes every check and returns the run as it would be created, without the id
        and created_at only a stored run gets; nothing is stored, announced or counted."""
        resolved = resolve(spec)
        validate(resolved)
        require_model_config(resolved.model.path)
        tokenizer_file(resolved.model.tokenizer_path)
        self.filters.check(resolved.rollout.filters)
        self.rollouts.check(resolved.rollout)
        if resolved.dataset.chat_template:
            await asyncio.to_thread(load_chat_template, resolved.model.tokenizer_path)
        await asyncio.to_thread(RunData.from_spec, resolved)
        await self._check_reward(resolved)
        run = Run(
            spec=resolved, state=RunState.RUN_STATE_QUEUED, progress=RunProgress(total_steps=resolved.schedule.steps)
        )
        if validate_only:
            return run
        run.id = f"run-{uuid.uuid4().hex[:12]}"
        run.created_at.CopyFrom(now())
        await self.store.create(run)
        self.metrics.count_run_state(None, run.state)
        logger.info("run %s submitted (%s)", run.id, resolved.name or "unnamed", extra={"run_id": run.id})
        self.notifier.publish(run)
        return run

    async def get(self, run_id: str) -> Run:
        return await self.store.get(run_id)

    async def list(self, state: RunState, page_size: int, page_token: str) -> ListRunsResponse:
        if state not in RunState.values():
            raise InvalidInput(f"state: unknown run state {state}")
        runs, token = await self.store.page(state, page_size, page_token)
        return ListRunsResponse(runs=runs, next_page_token=token)

    async def cancel(self, run_id: str) -> Run:
        """QUEUED or RUNNING -> CANCELLED; a finished run is a Conflict."""

        def mark(run: Run) -> None:
            run.state = RunState.RUN_STATE_CANCELLED
            run.finished_at.CopyFrom(now())

        try:
            return await self.update(run_id, mark)
        except RunEnded as exc:
            raise Conflict(f"{exc}: it cannot be cancelled") from None

    async def watch(self, run_id: str) -> AsyncIterator[RunEvent]:
        """The run now, then every change until it ends (or the orchestrator shuts down)."""
        event = self.notifier.subscribe(run_id)
        run = await self.store.get(run_id)
        yield RunEvent(run=run, message=describe_change(None, run), time=now())
        while not is_terminal(run.state) and not self._closing:
            try:
                # The timeout bounds each wait and picks up changes another process wrote to Redis.
                async with asyncio.timeout(self.poll_interval_s):
                    await event.wait()
            except TimeoutError:
                pass
            event = self.notifier.subscribe(run_id)
            latest = await self.store.get(run_id)
            if latest != run:
                yield RunEvent(run=latest, message=describe_change(run, latest), time=now())
                run = latest

    def close(self) -> None:
        """Ends every watch (at shutdown)."""
        self._closing = True
        self.notifier.wake_all()

    # -- used by the run loop -----------------------------------------------------------------

    async def update(self, run_id: str, mutate: Callable[[Run], None], *, after_end: bool = False) -> Run:
        """Applies `mutate` to the stored run and writes it back; RunEnded if the run already finished, unless
        `after_end` (the trainer's final progress, known only once it has stopped the run: trainer_release.py)."""
        async with self._lock:
            run = await self.store.get(run_id)
            if is_terminal(run.state) and not after_end:
                raise RunEnded(f"run {run_id} already {state_name(run.state)}")
            before = run.SerializeToString(deterministic=True)
            old_state = run.state
            mutate(run)
            if run.SerializeToString(deterministic=True) == before:
                return run
            ended = is_terminal(run.state) and not is_terminal(old_state)
            await self.store.put(run, expire_data_after_s=self.run_data_retention_s if ended else None)
        self.metrics.count_run_state(old_state, run.state)
        if run.state != old_state:
            logger.info("run %s is %s", run_id, state_name(run.state), extra={"run_id": run_id})
        self.notifier.publish(run)
        return run

    async def _check_reward(self, spec: RunSpec) -> None:
        """The reward hub checks the spec's reward (functions, params, time limit) as its /score will, and the
        time limit must leave room inside this orchestrator's own bound on a /score call.

        A hub that cannot be asked refuses the submit (Unavailable): accepting the run unchecked would break
        the promise that a stored spec was validated in full, and leave a bad term to fail the run later.
        """
        try:
            problems = await self.reward.spec_problems(spec.reward)
        except (Unavailable, DeadlineExceeded) as exc:
            raise Unavailable(
                f"the reward hub could not check the spec's reward ({exc}); nothing was stored: submit again once "
                "it answers"
            ) from exc
        if problems:
            raise InvalidInput("; ".join(f"reward.{p.field}: {p.message}" for p in problems))
        limit = self.reward.score_timeout_s
        if spec.reward.HasField("timeout_seconds") and spec.reward.timeout_seconds >= limit:
            raise InvalidInput(
                f"reward.timeout_seconds: {spec.reward.timeout_seconds:g} s is not below this orchestrator's limit on "
                f"one /score call ({limit:g} s, --score-timeout): one item that runs to its own limit would fail its "
                "whole group; lower it, or raise the orchestrator's --score-timeout"
            )
