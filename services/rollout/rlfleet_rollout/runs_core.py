"""The Runs API without a transport: Submit, Get, List, Cancel and Watch over the run store.

The REST app and the gRPC servicer are thin layers over this object; the run loop writes progress
through `update`, the same path Cancel takes, a compare-and-set on the record (run_store.py), so a
cancelled run cannot be overwritten by a loop that has not noticed yet, in this process or another. The run loop
writes through a view of this object that fences its run (`fenced`): each of its writes of the run checks, in the
write's transaction, that the run is still its driver's (run_fence.py).

The API's callers reach the records through a store of their own (`api_store`: its own Redis client in the
orchestrator), so that however many call, the run loop's writes find a connection; and the watchers of a run here
share one reader of its record (run_events.py): Redis sees one read per change, however many watch. A watch ends
with the run as its driver left it: the trainer's final progress, recorded after the run's end once the trainer has
stopped, is in its last event (the reader asks whether an orchestrator still holds the run's lease, run_lease.py).

List's page tokens are opaque (AIP-158) and page on only the listing they came from: a token names the state filter
it was made for, and a List by another state is refused, as it would list from the middle of another set of runs
and leave out every run before it (`to_page_token`, `page_cursor`).

Redis unreachable once its client's retries have run out, or refusing writes (full, read-only, unable to persist:
redis_outage.py), is Unavailable to the API's callers (503 / UNAVAILABLE, "run records (Redis) unreachable: ..." or
"... refuse writes: ..."): a dependency is down, nothing of ours failed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import logging
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path

import redis
from google.protobuf.timestamp_pb2 import Timestamp

from rlfleet.errors import AlreadyExists, Conflict, DeadlineExceeded, InvalidInput, Unavailable
from rlfleet.run_spec import resolve, validate
from rlfleet.sample_stream import REDIS_RETRY_ERRORS, redis_refusal
from rlfleet.v1.runs_pb2 import ListRunsResponse, Run, RunEvent, RunProgress, RunSpec, RunState
from rlfleet_rollout.datasets import eval_path_rows
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.model_directory import require_model_config, require_under_roots
from rlfleet_rollout.prompt_tokenizer import load_chat_template, tokenizer_file
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_counts import RunCounts
from rlfleet_rollout.run_data import RunData
from rlfleet_rollout.run_events import RunFeeds, RunNotifier, describe_change, is_terminal, state_name
from rlfleet_rollout.run_fence import RunFence
from rlfleet_rollout.run_lease import lease_key
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.spec_size import require_spec_fits
from rlfleet_rollout.submit_requests import RequestRecord, SubmitRequest

logger = logging.getLogger(__name__)


class RunEnded(Conflict):
    """The run reached a final state (e.g. it was cancelled) while someone still meant to change it."""


class ShuttingDown(Unavailable):
    """A watch ended because the orchestrator stops, not because the run did: watch again (at the next one)."""


SHUTTING_DOWN = "orchestrator shutting down; watch again"


def require_id(run_id: str) -> None:
    """InvalidInput for a request that names no run (an empty id is no run's, and would read as 'not found')."""
    if not run_id:
        raise InvalidInput("id: required: the id of a run, as Submit and List return it")


def unknown_state(value: object) -> InvalidInput:
    """The refusal of a List filter that names no run state, worded alike for REST's name and gRPC's number, and
    listing the states there are: gRPC's said only `unknown run state 99`."""
    known = ", ".join(state_name(s) for s in RunState.values() if s != RunState.RUN_STATE_UNSPECIFIED)
    return InvalidInput(f"state: unknown run state {value!r}; one of {known}")


_PAGE_TOKEN_VERSION = "p1"
_PAGE_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _listing(state: RunState) -> str:
    return "every run" if state == RunState.RUN_STATE_UNSPECIFIED else f"the {state_name(state)} runs"


def to_page_token(state: RunState, cursor: str) -> str:
    """The page token of the run store's `cursor` ("" after the last page) in a List by `state`: URL-safe and
    opaque, no bare number a client would read as a run's position. One a client makes up pages from wherever it
    says, which shows nothing a List from the start does not."""
    if not cursor:
        return ""
    raw = f"{_PAGE_TOKEN_VERSION}:{state_name(state)}:{cursor}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def page_cursor(state: RunState, token: str) -> str:
    """The run store's cursor in `token` ("" for none); InvalidInput naming page_token for a token List did not
    return, or one it returned for a List by another state."""
    if not token:
        return ""
    refused = InvalidInput(f"page_token: {token[:40]!r} is not a token returned by List")
    if len(token) > 64 or not set(token) <= _PAGE_TOKEN_CHARS:
        raise refused
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("ascii")
    except (binascii.Error, ValueError):
        raise refused from None
    version, listed, cursor = (raw.split(":") + ["", ""])[:3]
    # A creation number has at most 19 digits (run_store.py).
    if version != _PAGE_TOKEN_VERSION or not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 19):
        raise refused
    if listed != state_name(state):
        was = RunState.Value(f"RUN_STATE_{listed}") if f"RUN_STATE_{listed}" in RunState.keys() else None
        raise InvalidInput(
            f"page_token: it pages on a List of {_listing(was) if was is not None else listed}, not of "
            f"{_listing(state)}: a token pages on only the listing it came from (page_size may change); to list "
            f"{_listing(state)}, start again without a page_token"
        )
    return cursor


@contextlib.contextmanager
def records_reachable() -> Iterator[None]:
    """Redis unavailable (unreachable beyond the client's retries, or refusing writes) becomes Unavailable naming
    Redis."""
    try:
        yield
    except REDIS_RETRY_ERRORS as exc:
        raise Unavailable(f"run records (Redis) unreachable: {exc}") from exc
    except redis.ResponseError as exc:
        why = redis_refusal(exc)
        if why is None:
            raise
        raise Unavailable(f"run records (Redis) refuse writes: {why}") from exc


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
        data_roots: Sequence[Path] = (),
        api_store: RunStore | None = None,
    ) -> None:
        """`store` is the run loop's; `api_store` the one the API's callers read and write through (`store` if not
        given), over a Redis client whose connections are theirs alone. `data_roots`: the directories every path
        of a spec must lie under (RolloutConfig.data_roots); none: any."""
        self.filters = filters
        self.rollouts = rollouts
        self.store = store
        self.api_store = api_store or store
        self.reward = reward
        self.notifier = notifier
        self.metrics = metrics
        self.run_data_retention_s = run_data_retention_s
        self.data_roots = tuple(data_roots)
        self.run_counts = RunCounts(store, metrics)
        """The runs-by-state gauge; its task (`run_counts.serve()`) is the caller's to run and cancel."""
        # The run loop's writers of a run take turns (each retry of one would cost the others theirs); a lock for
        # each run, gone once unused, so a write waiting out Redis holds up no other run's.
        self._writing: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._closing = False
        self._fence: RunFence | None = None
        self.feeds = RunFeeds(notifier, self.get, poll_interval_s, driven=self._driven)
        """The reader of each watched run, shared by its watchers."""

    # -- the API ------------------------------------------------------------------------------

    async def submit(self, spec: RunSpec, *, validate_only: bool = False, request_id: str = "") -> Run:
        """Resolves and validates `spec` in full, then stores the run QUEUED; nothing is stored if it is bad.

        `validate_only` (AIP-163) makes every check and returns the run as it would be created, without the id
        and created_at only a stored run gets; nothing is stored, announced or counted.

        `request_id` (AIP-155; submit_requests.py) makes a retry safe: a Submit of a request_id that already made a
        run is answered that run as it is now, unchecked and with nothing stored, and one with another spec is
        AlreadyExists; concurrent Submits of one request_id store one run."""
        request = SubmitRequest.of(request_id, spec) if request_id else None
        if request is not None and not validate_only:
            with records_reachable():
                earlier = await self.api_store.request_record(request.request_id)
            if earlier is not None:  # checked before the spec: a retry is not refused for a reward hub down now
                return await self._run_of_request(request, earlier)
        resolved = resolve(spec)
        require_spec_fits(resolved)  # first: the checks after it would read a spec that cannot be taken
        validate(resolved)
        require_under_roots(resolved, self.data_roots)  # before any of them is opened
        require_model_config(resolved.model.path)
        tokenizer_file(resolved.model.tokenizer_path)
        self.filters.check(resolved.rollout.filters)
        self.rollouts.check(resolved.rollout)
        if resolved.dataset.chat_template:
            await asyncio.to_thread(load_chat_template, resolved.model.tokenizer_path)
        if not spec.dataset.HasField("eval_size"):
            # An eval_path holds the rows to evaluate on: unless told how many, every one of them, up to the default.
            held = await asyncio.to_thread(eval_path_rows, resolved.dataset)
            if held:
                resolved.dataset.eval_size = min(resolved.dataset.eval_size, held)
        await asyncio.to_thread(RunData.from_spec, resolved)
        await self._check_reward(resolved)
        run = Run(
            spec=resolved, state=RunState.RUN_STATE_QUEUED, progress=RunProgress(total_steps=resolved.schedule.steps)
        )
        if validate_only:
            return run
        run.id = f"run-{uuid.uuid4().hex[:12]}"
        run.created_at.CopyFrom(now())
        with records_reachable():
            earlier = await self.api_store.create(run, request)
        if earlier is not None:  # another Submit of the request_id stored its run first
            assert request is not None
            return await self._run_of_request(request, earlier)
        self.run_counts.changed()
        logger.info("run %s submitted (%s)", run.id, resolved.name or "unnamed", extra={"run_id": run.id})
        self.notifier.publish(run)
        return run

    async def _run_of_request(self, request: SubmitRequest, earlier: RequestRecord) -> Run:
        """The run an earlier Submit of `request`'s request_id made, as it is now; AlreadyExists if that Submit sent
        another spec."""
        if earlier.spec_sha256 != request.spec_sha256:
            raise AlreadyExists(
                f"request_id: {request.request_id!r} was already used by a Submit of another spec, which made run "
                f"{earlier.run_id}; a request_id names one Submit: send another spec with a fresh request_id"
            )
        logger.info(
            "Submit repeated with request_id %s: answered with run %s, nothing stored",
            request.request_id,
            earlier.run_id,
            extra={"run_id": earlier.run_id, "request_id": request.request_id},
        )
        with records_reachable():
            return await self.api_store.get(earlier.run_id)

    async def get(self, run_id: str) -> Run:
        require_id(run_id)
        with records_reachable():
            return await self.api_store.get(run_id)

    async def list(self, state: RunState, page_size: int, page_token: str) -> ListRunsResponse:
        if state not in RunState.values():
            raise unknown_state(state)
        cursor = page_cursor(state, page_token)
        with records_reachable():
            runs, after = await self.api_store.page(state, page_size, cursor)
        return ListRunsResponse(runs=runs, next_page_token=to_page_token(state, after))

    async def cancel(self, run_id: str) -> Run:
        """QUEUED or RUNNING -> CANCELLED; a finished run is a Conflict, one already CANCELLED too (a second Cancel).
        A Cancel whose write went through but whose reply from Redis was lost is answered CANCELLED: the store knows
        the write as its own (RunStore.update)."""

        def mark(run: Run) -> None:
            run.state = RunState.RUN_STATE_CANCELLED
            run.stalled = ""
            run.finished_at.CopyFrom(now())

        require_id(run_id)
        try:
            with records_reachable():
                return await self.update(run_id, mark, by_caller=True)
        except RunEnded as exc:
            raise Conflict(f"{exc}: it cannot be cancelled") from None

    async def watch(self, run_id: str) -> AsyncGenerator[RunEvent, None]:
        """The run now, then its latest state after each change until it ends: changes written back to back may
        come as one event (run_events.py). The run's end comes once, as its driver left it (the trainer's final
        progress in), held back for at most `feeds.end_wait_s`; a watch of a run that has ended gets it as it stands
        and ends. ShuttingDown if the orchestrator stops first."""
        require_id(run_id)
        if self._closing:
            raise ShuttingDown(SHUTTING_DOWN)
        with self.feeds.watching(run_id) as feed:
            shown: Run | None = None
            while shown is None or not is_terminal(shown.state):
                run = await feed.after(shown)
                yield RunEvent(run=run, message=describe_change(shown, run), time=now())
                shown = run

    async def _driven(self, run_id: str) -> bool:
        """Whether an orchestrator drives `run_id` now (holds its lease): one that ended is let go of once its trainer
        has stopped and the trainer's final progress is recorded."""
        with records_reachable():
            return bool(await self.api_store.client.exists(lease_key(self.api_store.prefix, run_id)))

    def close(self) -> None:
        """Ends every watch of a run still going with ShuttingDown (at shutdown)."""
        self._closing = True
        self.feeds.close(ShuttingDown(SHUTTING_DOWN))

    # -- used by the run loop -----------------------------------------------------------------

    def fenced(self, fence: RunFence) -> RunsCore:
        """This core as the driver of `fence.run_id` writes through it: each run-loop write of that run (not a
        caller's Cancel, nor a write of another run, e.g. the final progress of one the trainer is freed of) is
        refused, FencedOut, unless the run is still the driver's (run_fence.py). Everything else (the stores, the
        writers' turns, the notifier, the feeds) is this core's own."""
        view = copy.copy(self)
        view._fence = fence
        return view

    async def update(
        self, run_id: str, mutate: Callable[[Run], None], *, after_end: bool = False, by_caller: bool = False
    ) -> Run:
        """Applies `mutate` to the stored run and writes it back, unless another writer came between (then it is
        applied again to what that one wrote); RunEnded if the run already finished, unless `after_end` (the
        trainer's final progress, known only once it has stopped the run: trainer_release.py). A final state is
        never changed. A write of the run loop's waits for this process's other writers of the run to be done;
        one `by_caller` (Cancel) goes through the API's store, and not in turn: a caller's wait is Redis's
        retries alone, never theirs too. Redis errors are raised as the client's (the run loop waits them out)."""

        def guarded(run: Run) -> None:
            state = run.state
            if is_terminal(state) and not after_end:
                raise RunEnded(f"run {run_id} already {state_name(state)}")
            mutate(run)
            if is_terminal(state) and run.state != state:
                raise RunEnded(f"run {run_id} already {state_name(state)}, which is final")

        # Turns spare this process's writers each other's retries; the compare-and-set guards against the rest.
        store = self.api_store if by_caller else self.store
        fence = self._fence if self._fence is not None and self._fence.run_id == run_id and not by_caller else None
        async with contextlib.nullcontext() if by_caller else self._turn(run_id):
            old, run = await store.update(run_id, guarded, expire_data_after_s=self.run_data_retention_s, fence=fence)
        if run is old:
            return run
        old_state = old.state
        if run.state != old_state:
            self.run_counts.changed()
            logger.info("run %s is %s", run_id, state_name(run.state), extra={"run_id": run_id})
        self.notifier.publish(run)
        return run

    def _turn(self, run_id: str) -> asyncio.Lock:
        lock = self._writing.get(run_id)
        if lock is None:
            lock = self._writing[run_id] = asyncio.Lock()
        return lock

    async def _check_reward(self, spec: RunSpec) -> None:
        """The reward hub checks the spec's reward (functions, params, time limit) as its /score will, and the
        time limit must leave room inside this orchestrator's own bound on a /score call.

        A hub that cannot be asked refuses the submit (Unavailable; Conflict when it answers with an error of its
        own, a misconfigured hub): accepting the run unchecked would break the promise that a stored spec was
        validated in full, and leave a bad term to fail the run later.
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
