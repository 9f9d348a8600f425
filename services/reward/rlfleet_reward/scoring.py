"""The hub's transport-free core: validate a ScoreRequest, score every (item, term), combine per item.

Every term scores all the items at once, the terms side by side: on the worker pool, which hands the
items to its workers in chunks, or, for `async def` functions (network calls), on the event loop, one
call per item, at most `max_concurrent_io_calls` at a time, each followed by the function's `finish`, if
it has one, in the pool. An item's result is OK only when all its terms are: then `score` is the
weighted sum and `components` holds each term's unweighted score (plus `<function>/<part>` sub-scores).
Otherwise the item is TIMEOUT (some term exceeded the limit) or ERROR (some term failed, or the weighted
sum overflowed), with score 0, no components, and `error` naming the function and the reason. A term whose
function declares a `timeout_score` (the verifiers: a response they cannot check in time is wrong) is not a
TIMEOUT when it runs out of time: it scores that, with a `<function>/timed_out` component of 1, and is still
counted as a timeout in the metrics. One bad item never fails the batch; only a malformed request does, or
one the hub found no room for within its bounded wait (`admission`): a hub too busy to take the request is
the hub's failure, never the response's, so it never scores 0. An item's `seconds` is the time its function
calls took, summed.

`validate_spec` runs the same checks on a spec alone, without items: the orchestrator asks it at
submit, so a spec `score` would refuse fails then rather than at the run's first step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2
from pydantic import ValidationError

from rlfleet.errors import InvalidInput, ResourceExhausted, RlfleetError, Unavailable
from rlfleet.sample_stream import MAX_MAGNITUDE
from rlfleet.v1 import reward_pb2
from rlfleet_reward.admission import Admission
from rlfleet_reward.metrics import RewardMetrics
from rlfleet_reward.registry import Registry
from rlfleet_reward.reward_function import INPUT_FIELDS, RewardFunction, RewardInput
from rlfleet_reward.sandbox_memory import PARAMS_CONTEXT_KEY
from rlfleet_reward.time_limit import TimeLimitExceeded
from rlfleet_reward.worker import checked_reply, failure_reply
from rlfleet_reward.worker_pool import JobResult, JobStatus, WorkerPool

# The most problems listed for one term's params; the rest are counted. Listed all, a 1.4 MB spec of 100,000 unknown
# params drew an 8.3 MB answer from /validate, and a 6.2 MB refusal from /score.
MAX_PARAMS_PROBLEMS = 10
# The part, `<function>/timed_out`, that marks a term scored by its `timeout_score` because the item ran out of time.
TIMED_OUT_PART = "timed_out"


@dataclass(frozen=True)
class ScoringLimits:
    default_timeout_seconds: float
    max_timeout_seconds: float
    max_batch_size: int
    max_concurrent_io_calls: int = 64
    max_pending_jobs: int = 16384
    admission_wait_seconds: float = 5.0
    max_waiting_requests: int = 64


@dataclass(frozen=True)
class _Term:
    name: str
    function: RewardFunction
    weight: float
    params: Mapping[str, Any]


class Scorer:
    def __init__(self, registry: Registry, pool: WorkerPool, limits: ScoringLimits, metrics: RewardMetrics) -> None:
        self.registry = registry
        self.pool = pool
        self.limits = limits
        self.metrics = metrics
        self._io_slots = asyncio.Semaphore(limits.max_concurrent_io_calls)
        # What the params models cannot know alone: `code` refuses a `memory_mb` past a worker's share of this.
        self._params_context = {PARAMS_CONTEXT_KEY: pool.memory_budget}
        self.admission = Admission(limits.max_pending_jobs, limits.admission_wait_seconds, limits.max_waiting_requests)
        metrics.add_functions(registry)
        metrics.watch_admission(self.admission)
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        """Ends every request still being scored with Unavailable (at shutdown, once the grace period is spent), so
        each gets an answer naming why rather than the cut connection, or the 500, of a server that gives up."""
        self._stopped.set()

    async def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        """Every item scored by every term; each request is counted once by its outcome: ok, cancelled (the
        client left), the kind of error that refused it (unavailable when the hub stopped first), or internal
        (a fault of ours)."""
        outcome = "internal"
        try:
            work = asyncio.ensure_future(self._score(request))
            stopped = asyncio.ensure_future(self._stopped.wait())
            try:
                await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                if not work.done():
                    work.cancel()  # its workers are given back, its items still waiting dropped
                    await asyncio.gather(work, return_exceptions=True)
            if work.cancelled():
                raise Unavailable(
                    "the reward hub is shutting down and its grace period (--shutdown-grace-seconds) is over; "
                    "send the request again, to another replica or once the hub is back"
                )
            response = work.result()
            outcome = "ok"
            return response
        except RlfleetError as exc:
            outcome = exc.kind
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()

    async def _score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        terms, timeout = self._validate(request)
        async with self.admission.admit(len(request.items) * len(terms)):
            scoring = [asyncio.ensure_future(self._score_term(request.items, term, timeout)) for term in terms]
            try:
                by_term = await asyncio.gather(*scoring)
            finally:
                # gather leaves the other terms running when one fails the request (the pool down): they would go
                # on calling out, holding io slots and workers, for answers nobody reads. Stopped before the room
                # they hold is given back.
                for task in scoring:
                    task.cancel()
                await asyncio.gather(*scoring, return_exceptions=True)
        results = [
            self._combine(item, terms, [outcomes[i] for outcomes in by_term]) for i, item in enumerate(request.items)
        ]
        return reward_pb2.ScoreResponse(results=results)

    def list_functions(self) -> reward_pb2.ListFunctionsResponse:
        return reward_pb2.ListFunctionsResponse(
            functions=[
                reward_pb2.RewardFunctionInfo(
                    name=name,
                    description=function.description,
                    inputs=[field for field in INPUT_FIELDS if field in function.inputs],
                )
                for name, function in self.registry.items()
            ]
        )

    def validate_spec(self, request: reward_pb2.ValidateSpecRequest) -> reward_pb2.ValidateSpecResponse:
        """Everything `score` would refuse `request.spec` for, without scoring: how a RunSpec is checked at submit."""
        _, _, problems = self._check_spec(request.spec)
        return reward_pb2.ValidateSpecResponse(problems=problems)

    def _validate(self, request: reward_pb2.ScoreRequest) -> tuple[list[_Term], float]:
        if not request.items:
            raise InvalidInput("items is empty; send at least one item to score")
        if len(request.items) > self.limits.max_batch_size:
            raise ResourceExhausted(
                f"items has {len(request.items)} entries; the limit is {self.limits.max_batch_size} per request, "
                "split the batch"
            )
        _check_ids(request.items)
        terms, timeout, problems = self._check_spec(request.spec)
        if problems:
            raise InvalidInput("; ".join(f"spec.{p.field}: {p.message}" for p in problems))
        return terms, timeout

    def _check_spec(self, spec: reward_pb2.RewardSpec) -> tuple[list[_Term], float, list[reward_pb2.SpecProblem]]:
        """The spec's terms and time limit, and every problem found (field paths relative to the spec)."""
        problems: list[reward_pb2.SpecProblem] = []

        def problem(field: str, message: str) -> None:
            problems.append(reward_pb2.SpecProblem(field=field, message=message))

        if not spec.terms:
            problem("terms", f"name at least one reward function (known: {', '.join(self.registry)})")
        if len(spec.terms) > len(self.registry):
            # Each function may appear once: no more terms can be right, and a problem per term, each naming every
            # function, made a small request's answer many times its size.
            problem(
                "terms",
                f"has {len(spec.terms)} entries, but each reward function may appear once and the hub has "
                f"{len(self.registry)} (known: {', '.join(self.registry)})",
            )
            return [], 0.0, problems
        terms: list[_Term] = []
        for i, term in enumerate(spec.terms):
            where = f"terms[{i}]"
            if term.function not in self.registry:
                problem(
                    f"{where}.function",
                    f"unknown reward function {term.function!r}; known: {', '.join(self.registry)}",
                )
                continue
            if any(t.name == term.function for t in terms):
                problem(f"{where}.function", f"{term.function!r} appears twice; components are keyed by name")
                continue
            weight = term.weight if term.HasField("weight") else 1.0
            if not math.isfinite(weight):
                problem(f"{where}.weight", f"must be a finite number, got {weight}")
            function = self.registry.get(term.function)
            params, params_problems = self._params(where, term, function)
            problems += params_problems
            terms.append(_Term(term.function, function, weight, params))
        timeout = spec.timeout_seconds if spec.HasField("timeout_seconds") else self.limits.default_timeout_seconds
        if not (math.isfinite(timeout) and 0 < timeout <= self.limits.max_timeout_seconds):
            problem("timeout_seconds", f"must be > 0 and <= {self.limits.max_timeout_seconds:g}, got {timeout}")
        return terms, timeout, problems

    def _params(
        self, where: str, term: reward_pb2.RewardTerm, function: RewardFunction
    ) -> tuple[Mapping[str, Any], list[reward_pb2.SpecProblem]]:
        """The term's params validated against the function's model (defaults filled in), with the hub's memory
        budget in the validation context, or what is wrong."""
        non_finite = _non_finite_numbers(term.params)
        if non_finite:
            # JSON has no NaN or infinity, so neither does the params model (nor MessageToDict, which raises).
            return {}, _listed(
                where,
                len(non_finite),
                [
                    reward_pb2.SpecProblem(
                        field=f"{where}.params{path}", message=f"must be a finite number, got {number}"
                    )
                    for path, number in non_finite[:MAX_PARAMS_PROBLEMS]
                ],
            )
        raw = json_format.MessageToDict(term.params)
        if function.params is None:
            if raw:
                names = sorted(raw)
                shown = str(names)
                if len(names) > MAX_PARAMS_PROBLEMS:
                    shown = f"{len(names)}: {names[:MAX_PARAMS_PROBLEMS]} and {len(names) - MAX_PARAMS_PROBLEMS} more"
                message = f"{term.function!r} takes no params, got {shown}"
                return {}, [reward_pb2.SpecProblem(field=f"{where}.params", message=message)]
            return {}, []
        try:
            return function.params.model_validate(raw, context=self._params_context).model_dump(), []
        except ValidationError as exc:
            return {}, _listed(
                where,
                exc.error_count(),
                [
                    reward_pb2.SpecProblem(
                        field=".".join([f"{where}.params", *(str(p) for p in err["loc"])]), message=err["msg"]
                    )
                    for err in exc.errors()[:MAX_PARAMS_PROBLEMS]
                ],
            )

    async def _score_term(self, items: Sequence[reward_pb2.ScoreItem], term: _Term, timeout: float) -> list[JobResult]:
        """Every item scored by one term; metrics counted once per status rather than once per item."""
        samples = [_sample(item, term.function.inputs) for item in items]
        if term.function.waits_on_io:
            outcomes = list(await asyncio.gather(*(self._run_on_loop(term, sample, timeout) for sample in samples)))
        else:
            outcomes = await self.pool.run(term.name, term.params, samples, timeout)
        seconds = self.metrics.item_seconds.labels(term.name)
        for outcome in outcomes:
            seconds.observe(outcome.seconds)
        for status, count in Counter(outcome.status for outcome in outcomes).items():
            self.metrics.items.labels(term.name, status.value).inc(count)
            if status is JobStatus.TIMEOUT:
                self.metrics.timeouts.labels(term.name).inc(count)
        on_timeout = term.function.timeout_score
        if on_timeout is None:
            return outcomes
        return [
            _scored_timeout(outcome, on_timeout) if outcome.status is JobStatus.TIMEOUT else outcome
            for outcome in outcomes
        ]

    async def _run_on_loop(self, term: _Term, sample: RewardInput, timeout: float) -> JobResult:
        finish = term.function.finish
        async with self._io_slots:
            self.metrics.io_calls_in_flight.inc()
            started = time.monotonic()
            limit = asyncio.timeout(timeout)
            try:
                async with limit:
                    value = await term.function.fn(sample, term.params)  # type: ignore[misc]  # async here
                reply = None if finish is not None else checked_reply(value)
            except Exception as exc:  # noqa: BLE001 - a function's failure is the item's ERROR
                if limit.expired():  # the item's limit, not a TimeoutError the function raised itself
                    return _timed_out(timeout)
                reply = failure_reply(exc)
            except TimeLimitExceeded as exc:  # a limit of the function's own
                return JobResult(JobStatus.TIMEOUT, error=str(exc), seconds=time.monotonic() - started)
            finally:
                self.metrics.io_calls_in_flight.dec()
        spent = time.monotonic() - started
        if reply is not None:
            return JobResult.from_reply(reply, spent)
        return await self._finish(term, value, timeout, spent)

    async def _finish(self, term: _Term, fetched: object, timeout: float, spent: float) -> JobResult:
        """The term's `finish` on what its `fn` fetched, in the pool, within what is left of the item's limit."""
        if not isinstance(fetched, RewardInput):
            error = f"its async part returned a {type(fetched).__name__}; its finish needs a RewardInput"
            return JobResult(JobStatus.ERROR, error=error, seconds=spent)
        if spent >= timeout:
            return _timed_out(timeout)
        (result,) = await self.pool.run(term.name, term.params, [fetched], timeout - spent)
        if result.status is JobStatus.TIMEOUT:
            return _timed_out(timeout)
        return dataclasses.replace(result, seconds=spent + result.seconds)

    @staticmethod
    def _combine(
        item: reward_pb2.ScoreItem, terms: Sequence[_Term], outcomes: Sequence[JobResult]
    ) -> reward_pb2.ScoreResult:
        result = reward_pb2.ScoreResult(id=item.id, seconds=sum(o.seconds for o in outcomes))
        failed = [(t, o) for t, o in zip(terms, outcomes, strict=True) if o.status is not JobStatus.OK]
        if failed:
            timed_out = any(o.status is JobStatus.TIMEOUT for _, o in failed)
            result.status = reward_pb2.SCORE_STATUS_TIMEOUT if timed_out else reward_pb2.SCORE_STATUS_ERROR
            result.error = "; ".join(f"{t.name}: {o.error}" for t, o in failed)
            return result
        score = sum(term.weight * outcome.score for term, outcome in zip(terms, outcomes, strict=True))
        if not (math.isfinite(score) and abs(score) <= MAX_MAGNITUDE):
            # A sample carries at most that much reward (past it, the trainer's float32 arithmetic overflows): an OK
            # score beyond it would fail the run when its group reached the stream, not this item.
            result.status = reward_pb2.SCORE_STATUS_ERROR
            result.error = (
                f"the weighted sum of the terms' scores is {score:g}, past the largest reward a sample may carry "
                f"(+-{MAX_MAGNITUDE:g}); use smaller weights or scores"
            )
            return result
        result.status = reward_pb2.SCORE_STATUS_OK
        result.score = score
        for term, outcome in zip(terms, outcomes, strict=True):
            result.components[term.name] = outcome.score
            for part, value in outcome.parts.items():
                result.components[f"{term.name}/{part}"] = value
        return result


def _timed_out(timeout: float) -> JobResult:
    return JobResult(JobStatus.TIMEOUT, error=f"exceeded its {timeout:g} s time limit", seconds=timeout)


def _scored_timeout(outcome: JobResult, score: float) -> JobResult:
    """A TIMEOUT of a function that scores running out of time (a verifier: 0), marked `timed_out`."""
    return JobResult(JobStatus.OK, score=score, parts={TIMED_OUT_PART: 1.0}, seconds=outcome.seconds)


def _listed(where: str, found: int, listed: list[reward_pb2.SpecProblem]) -> list[reward_pb2.SpecProblem]:
    """`listed`, the first of the `found` problems of a term's params, and one more counting those left out."""
    if found <= len(listed):
        return listed
    more = reward_pb2.SpecProblem(
        field=f"{where}.params", message=f"{found - len(listed)} more problems, not listed; fix these first"
    )
    return [*listed, more]


def _non_finite_numbers(params: struct_pb2.Struct) -> list[tuple[str, float]]:
    """(path, number) of each NaN or infinity in `params`, the path as in pydantic's errors: `.a.0`."""
    found: list[tuple[str, float]] = []
    stack = [(f".{key}", value) for key, value in params.fields.items()]
    while stack:
        path, value = stack.pop()
        kind = value.WhichOneof("kind")
        if kind == "number_value" and not math.isfinite(value.number_value):
            found.append((path, value.number_value))
        elif kind == "struct_value":
            stack += [(f"{path}.{key}", inner) for key, inner in value.struct_value.fields.items()]
        elif kind == "list_value":
            stack += [(f"{path}.{index}", inner) for index, inner in enumerate(value.list_value.values)]
    return sorted(found)


# How much of an id a refusal quotes: enough to find the item, not a copy of an oversized one.
_SHOWN_ID_CHARS = 100


def _check_ids(items: Sequence[reward_pb2.ScoreItem]) -> None:
    """InvalidInput naming the first item whose id another item before it has. Each result carries its item's id, and
    a caller that matches results to items by id (the orchestrator's evaluation does) would read one item's result for
    both. An empty id is no id: results also come in request order, which is how a caller without ids reads them."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if not item.id:
            continue
        seen = first.setdefault(item.id, i)
        if seen != i:
            shown = item.id if len(item.id) <= _SHOWN_ID_CHARS else f"{item.id[:_SHOWN_ID_CHARS]}..."
            raise InvalidInput(
                f"items[{i}].id: {shown!r} is also the id of items[{seen}]; results carry their item's id, so give "
                "each item its own (or leave ids empty and read the results in request order)"
            )


def _sample(item: reward_pb2.ScoreItem, inputs: frozenset[str]) -> RewardInput:
    """The item as the function sees it: only the fields it declared, so the rest never cross the pipe."""
    fields: dict[str, Any] = {name: getattr(item, name) for name in inputs}
    if "metadata" in fields:
        fields["metadata"] = dict(item.metadata)
    return RewardInput(**fields)
