"""Held-out evaluation: greedy generation of the eval split, scored at the reward hub.

accuracy: share of prompts whose response earns full marks (every reward term at 1, weighted);
a prompt whose generation or scoring failed counts as wrong. Greedy decoding gives one response
per prompt, so pass@k is pass@1, the accuracy. mean_length and truncation_rate are over the
responses the engines returned.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from rlfleet.arithmetic import Problem
from rlfleet.errors import RlfleetError, Unavailable
from rlfleet.v1.reward_pb2 import ScoreItem, ScoreStatus
from rlfleet.v1.runs_pb2 import EvalResult
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.concurrency import gather_cancelling
from rlfleet_rollout.group_producer import RolloutContext, full_marks
from rlfleet_rollout.router_client import Completion, sampling_body


@dataclass(frozen=True)
class _Outcome:
    correct: bool
    completion: Completion


async def _evaluate_batch(
    ctx: RolloutContext, run_id: str, step: int, start: int, problems: list[Problem]
) -> list[_Outcome]:
    prompts = [ctx.encode(p.prompt) for p in problems]
    attempt = uuid.uuid4().hex[:8]  # unique among requests in flight, as for training groups
    rids = [f"{run_id}/eval/{step}/{start + i}@{attempt}" for i in range(len(problems))]
    try:
        completions = await ctx.generate(prompts, sampling_body(ctx.spec.rollout.sampling, greedy=True), rids)
    except RlfleetError as exc:
        completions = [Completion(error=f"generation failed: {exc}")] * len(problems)
    items = [
        ScoreItem(id=str(i), prompt=p.prompt, response=ctx.response_text(c), label=p.answer)
        for i, (p, c) in enumerate(zip(problems, completions, strict=True))
        if not c.error
    ]
    results = {r.id: r for r in await ctx.score(items)}
    threshold = full_marks(ctx.spec.reward)
    outcomes = []
    for i, c in enumerate(completions):
        result = results.get(str(i))
        ok = result is not None and result.status == ScoreStatus.SCORE_STATUS_OK and result.score >= threshold
        outcomes.append(_Outcome(correct=ok, completion=c))
    return outcomes


async def evaluate(
    ctx: RolloutContext, run_id: str, step: int, problems: list[Problem], batch_size: int, trainer_version: int
) -> EvalResult:
    """The EvalResult of the current fleet weights on `problems`; Unavailable if no prompt got a response."""
    batches = [problems[i : i + batch_size] for i in range(0, len(problems), batch_size)]
    per_batch = await gather_cancelling(
        [_evaluate_batch(ctx, run_id, step, i * batch_size, batch) for i, batch in enumerate(batches)]
    )
    outcomes = [o for batch in per_batch for o in batch]
    answered = [o.completion for o in outcomes if not o.completion.error]
    if not answered:
        errors = {o.completion.error for o in outcomes}
        raise Unavailable(f"evaluation at step {step} got no response: {'; '.join(sorted(errors))[:500]}")
    versions = [c.weight_version for c in answered if c.weight_version is not None]
    accuracy = sum(o.correct for o in outcomes) / len(outcomes)
    return EvalResult(
        step=step,
        # The engines' own report wins: it is the version that actually answered.
        weight_version=max(versions) if versions else trainer_version,
        size=len(outcomes),
        accuracy=accuracy,
        pass_at_k=accuracy,
        mean_length=sum(len(c.output_ids) for c in answered) / len(answered),
        truncation_rate=sum(c.finish_reason == FinishReason.FINISH_REASON_LENGTH for c in answered) / len(answered),
    )
