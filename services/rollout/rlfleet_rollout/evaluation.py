"""Held-out evaluation: k samples of every held-out prompt (k = schedule.eval_samples), scored at the reward hub.

k = 1 is one greedy answer per prompt; k > 1 samples with the run's sampling parameters and
per-sample seeds. A run with an environment (multi_turn) is evaluated in whole episodes, its last
model turn scored, as in training. accuracy: share of samples that earn full marks (every reward
term of positive weight at 1, every penalty, a term of negative weight, at 0), mean@k; pass_at_k: share of
prompts with at least one such sample of their k, exact (the unbiased estimator 1 - C(n-c, k)/C(n, k) with n = k
samples drawn), for k = 1 the accuracy. A sample whose generation or scoring failed counts as wrong,
and in `failed`: a fleet that fails requests would otherwise pass for a model that answers worse.
mean_length and truncation_rate are over the responses the engines returned (every turn and
environment token of an episode).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from rlfleet.errors import RlfleetError, Unavailable
from rlfleet.v1.reward_pb2 import ScoreItem, ScoreStatus
from rlfleet.v1.runs_pb2 import EvalResult
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.concurrency import gather_cancelling
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.group_producer import RolloutContext, full_marks, sample_seed, seeded_sampling
from rlfleet_rollout.multi_turn import Episode, run_episode
from rlfleet_rollout.router_client import Completion, sampling_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Outcome:
    prompt_index: int
    correct: bool
    completion: Completion
    error: str = ""
    """Why the sample was not generated or not scored; empty when it was."""


async def _evaluate_batch(
    ctx: RolloutContext, run_id: str, step: int, start: int, prompts: list[Prompt], k: int
) -> list[_Outcome]:
    """`prompts` are held-out prompts start, start + 1, ...; each is asked k times."""
    cells = [(start + i, p, j) for i, p in enumerate(prompts) for j in range(k)]
    encoded = [ctx.encode(ctx.render(p.prompt)) for _, p, _ in cells]
    attempt = uuid.uuid4().hex[:8]  # unique among requests in flight, as for training groups
    rids = [f"{run_id}/eval/{step}/{index}/{j}@{attempt}" for index, _, j in cells]
    if k == 1:
        sampling = [sampling_body(ctx.spec.rollout.sampling, greedy=True)] * len(cells)
    else:
        # Seeds of their own (negative positions never name a train prompt), the same at every evaluation.
        seeds = [sample_seed(ctx.spec.dataset.seed, -1 - index, j) for index, _, j in cells]
        sampling = seeded_sampling(sampling_body(ctx.spec.rollout.sampling), seeds)
    # A prompt the model's context cannot hold is wrong on its own: sent, the engine's refusal (a 400) would
    # fail every prompt of the batch.
    completions = [Completion() for _ in cells]
    sent = []
    for i, ids in enumerate(encoded):
        try:
            sampling[i] = ctx.within_context(sampling[i], len(ids))
            sent.append(i)
        except RlfleetError as exc:
            completions[i] = Completion(error=f"not generated: {exc}")
    if sent:
        try:
            answers = await ctx.generate(
                [encoded[i] for i in sent], [sampling[i] for i in sent], [rids[i] for i in sent]
            )
        except RlfleetError as exc:
            answers = [Completion(error=f"generation failed: {exc}")] * len(sent)
        for i, answer in zip(sent, answers, strict=True):
            completions[i] = answer
    return await _judge(ctx, cells, completions, [ctx.response_text(c) for c in completions])


async def _evaluate_episodes(
    ctx: RolloutContext,
    run_id: str,
    step: int,
    start: int,
    prompts: list[Prompt],
    k: int,
    under_way: asyncio.Semaphore,
) -> list[_Outcome]:
    """As `_evaluate_batch`, one episode with the run's environment per held-out prompt and sample; an episode
    starts once `under_way` lets it (the evaluation's bound on episodes under way at once)."""
    environment = ctx.environment
    assert environment is not None
    cells = [(start + i, p, j) for i, p in enumerate(prompts) for j in range(k)]
    sampling = sampling_body(ctx.spec.rollout.sampling, greedy=k == 1)
    attempt = uuid.uuid4().hex[:8]

    async def episode(index: int, prompt: Prompt, j: int) -> Episode:
        async with under_way:
            return await run_episode(
                ctx,
                environment,
                prompt,
                ctx.encode(ctx.render(prompt.prompt)),
                sampling,
                None if k == 1 else sample_seed(ctx.spec.dataset.seed, -1 - index, j),
                f"{run_id}:eval:{step}:{index}:{j}@{attempt}",
            )

    episodes = await gather_cancelling([episode(index, p, j) for index, p, j in cells])
    return await _judge(ctx, cells, [e.completion for e in episodes], [e.final_turn for e in episodes])


async def _judge(
    ctx: RolloutContext, cells: list[tuple[int, Prompt, int]], completions: list[Completion], responses: list[str]
) -> list[_Outcome]:
    """Each cell's outcome: correct when its response (what the reward scores) earns full marks."""
    items = [
        ScoreItem(id=str(i), prompt=p.prompt, response=response, label=p.answer, metadata=p.metadata)
        for i, ((_, p, _), c, response) in enumerate(zip(cells, completions, responses, strict=True))
        if not c.error
    ]
    results = {r.id: r for r in await ctx.score(items)}
    threshold = full_marks(ctx.spec.reward)
    outcomes = []
    for i, ((index, _, _), c) in enumerate(zip(cells, completions, strict=True)):
        result = results.get(str(i))
        if result is not None and result.status == ScoreStatus.SCORE_STATUS_OK:
            outcomes.append(_Outcome(prompt_index=index, correct=result.score >= threshold, completion=c))
        else:
            error = c.error or (result.error if result is not None else "") or "scoring failed"
            outcomes.append(_Outcome(prompt_index=index, correct=False, completion=c, error=error))
    return outcomes


async def evaluate(
    ctx: RolloutContext, run_id: str, step: int, prompts: list[Prompt], batch_size: int, trainer_version: int
) -> EvalResult:
    """The EvalResult of the current fleet weights on `prompts`; Unavailable if no prompt got a response."""
    k = ctx.spec.schedule.eval_samples
    per_request = max(1, batch_size // k)  # a request holds about batch_size samples
    batches = [prompts[i : i + per_request] for i in range(0, len(prompts), per_request)]
    if ctx.environment is None:
        per_batch = await gather_cancelling(
            [_evaluate_batch(ctx, run_id, step, i * per_request, batch, k) for i, batch in enumerate(batches)]
        )
    else:
        # At most a batch of episodes under way: started all at once, every episode's first turn ran before any
        # second one, and their trajectories together passed the router's cache budget, which evicted the
        # episodes waiting for their next turn (a thousand held-out prompts lost a third of their samples).
        under_way = asyncio.Semaphore(batch_size)
        per_batch = await gather_cancelling(
            [
                _evaluate_episodes(ctx, run_id, step, i * per_request, batch, k, under_way)
                for i, batch in enumerate(batches)
            ]
        )
    outcomes = [o for batch in per_batch for o in batch]
    answered = [o.completion for o in outcomes if not o.completion.error]
    if not answered:
        errors = {o.completion.error for o in outcomes}
        raise Unavailable(f"evaluation at step {step} got no response: {'; '.join(sorted(errors))[:500]}")
    versions = [c.weight_version for c in answered if c.weight_version is not None]
    solved = {o.prompt_index for o in outcomes if o.correct}
    failed = [o.error for o in outcomes if o.error]
    if failed:
        logger.warning(
            "run %s eval at step %d: %d of %d samples failed and count as wrong: %s",
            run_id,
            step,
            len(failed),
            len(outcomes),
            "; ".join(sorted(set(failed)))[:500],
            extra={"run_id": run_id, "step": step},
        )
    return EvalResult(
        step=step,
        # The engines' own report wins: it is the version that actually answered.
        weight_version=max(versions) if versions else trainer_version,
        size=len(prompts),
        accuracy=sum(o.correct for o in outcomes) / len(outcomes),
        pass_at_k=len(solved) / len(prompts),
        mean_length=sum(len(c.output_ids) for c in answered) / len(answered),
        truncation_rate=sum(c.finish_reason == FinishReason.FINISH_REASON_LENGTH for c in answered) / len(answered),
        k=k,
        failed=len(failed),
    )
