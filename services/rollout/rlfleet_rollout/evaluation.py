"""Held-out evaluation: k samples of every held-out prompt (k = schedule.eval_samples), scored at the reward hub.

k = 1 is one greedy answer per prompt; k > 1 samples with the run's sampling parameters and
per-sample seeds. A run with an environment (multi_turn) is evaluated in whole episodes, its last
model turn scored, as in training. A held-out prompt that training would skip as too long (over
rollout.max_prompt_tokens, or leaving no room in the model's context) is left out, as verl leaves such
prompts out of its validation set, and counted in `prompts_too_long`: no figure counts it. accuracy: share
of samples that earn full marks (every reward term of positive weight at 1, every penalty, a term of
negative weight, at 0), mean@k; pass_at_k: share of prompts with at least one such sample of their k, exact
(the unbiased estimator 1 - C(n-c, k)/C(n, k) with n = k samples drawn), for k = 1 the accuracy. A sample
whose generation or scoring failed counts as wrong, and in `failed`: a fleet that fails requests would
otherwise pass for a model that answers worse. An evaluation none of whose samples was both generated and
scored has no figures at all (Unavailable). mean_length and truncation_rate are over the responses the
engines returned (every turn and environment token of an episode).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from rlfleet.errors import InvalidInput, RlfleetError, Unavailable
from rlfleet.v1.reward_pb2 import ScoreItem, ScoreStatus
from rlfleet.v1.runs_pb2 import EvalResult
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.concurrency import gather_cancelling
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.group_producer import RolloutContext, full_marks, prompt_too_long, sample_seed, seeded_sampling
from rlfleet_rollout.multi_turn import Episode, run_episode
from rlfleet_rollout.router_client import Completion, sampling_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _HeldOut:
    index: int
    """Position among the held-out prompts: it names the prompt's requests and seeds, skipped prompts or not."""
    prompt: Prompt
    ids: list[int]
    """The rendered prompt's tokens."""


@dataclass(frozen=True)
class _Outcome:
    prompt_index: int
    correct: bool
    completion: Completion
    error: str = ""
    """Why the sample was not generated or not scored; empty when it was."""


_Cell = tuple[_HeldOut, int]
"""A held-out prompt and the number of one of its k samples."""


async def _evaluate_batch(
    ctx: RolloutContext, run_id: str, step: int, held_out: list[_HeldOut], k: int
) -> list[_Outcome]:
    """Each of `held_out` asked k times in one request."""
    cells: list[_Cell] = [(h, j) for h in held_out for j in range(k)]
    attempt = uuid.uuid4().hex[:8]  # unique among requests in flight, as for training groups
    rids = [f"{run_id}/eval/{step}/{h.index}/{j}@{attempt}" for h, j in cells]
    if k == 1:
        sampling = [sampling_body(ctx.spec.rollout.sampling, greedy=True)] * len(cells)
    else:
        # Seeds of their own (negative positions never name a train prompt), the same at every evaluation.
        seeds = [sample_seed(ctx.spec.dataset.seed, -1 - h.index, j) for h, j in cells]
        sampling = seeded_sampling(sampling_body(ctx.spec.rollout.sampling), seeds)
    # Each prompt leaves room in the context (evaluate left out those that do not): max_new_tokens is cut to it.
    sampling = [ctx.within_context(params, len(h.ids)) for params, (h, _) in zip(sampling, cells, strict=True)]
    try:
        completions = await ctx.generate([h.ids for h, _ in cells], sampling, rids)
    except RlfleetError as exc:
        completions = [Completion(error=f"generation failed: {exc}")] * len(cells)
    return await _judge(ctx, cells, completions, [ctx.response_text(c) for c in completions])


async def _evaluate_episodes(
    ctx: RolloutContext, run_id: str, step: int, held_out: list[_HeldOut], k: int, under_way: asyncio.Semaphore
) -> list[_Outcome]:
    """As `_evaluate_batch`, one episode with the run's environment per held-out prompt and sample; an episode
    starts once `under_way` lets it (the evaluation's bound on episodes under way at once)."""
    environment = ctx.environment
    assert environment is not None
    cells: list[_Cell] = [(h, j) for h in held_out for j in range(k)]
    sampling = sampling_body(ctx.spec.rollout.sampling, greedy=k == 1)
    attempt = uuid.uuid4().hex[:8]

    async def episode(h: _HeldOut, j: int) -> Episode:
        async with under_way:
            return await run_episode(
                ctx,
                environment,
                h.prompt,
                h.ids,
                sampling,
                None if k == 1 else sample_seed(ctx.spec.dataset.seed, -1 - h.index, j),
                f"{run_id}:eval:{step}:{h.index}:{j}@{attempt}",
            )

    episodes = await gather_cancelling([episode(h, j) for h, j in cells])
    return await _judge(ctx, cells, [e.completion for e in episodes], [e.final_turn for e in episodes])


async def _judge(
    ctx: RolloutContext, cells: list[_Cell], completions: list[Completion], responses: list[str]
) -> list[_Outcome]:
    """Each cell's outcome: correct when its response (what the reward scores) earns full marks."""
    items = [
        ScoreItem(
            id=str(i), prompt=h.prompt.prompt, response=response, label=h.prompt.answer, metadata=h.prompt.metadata
        )
        for i, ((h, _), c, response) in enumerate(zip(cells, completions, responses, strict=True))
        if not c.error
    ]
    results = {r.id: r for r in await ctx.score(items)}
    threshold = full_marks(ctx.spec.reward)
    outcomes = []
    for i, ((h, _), c) in enumerate(zip(cells, completions, strict=True)):
        result = results.get(str(i))
        if result is not None and result.status == ScoreStatus.SCORE_STATUS_OK:
            outcomes.append(_Outcome(prompt_index=h.index, correct=result.score >= threshold, completion=c))
        else:
            error = c.error or (result.error if result is not None else "") or "scoring failed"
            outcomes.append(_Outcome(prompt_index=h.index, correct=False, completion=c, error=error))
    return outcomes


def _nothing_to_evaluate(ctx: RolloutContext, held_out: list[_HeldOut]) -> InvalidInput:
    """The error of a held-out split every prompt of which is too long, naming what to change."""
    n, shortest = len(held_out), min((len(h.ids) for h in held_out), default=0)
    limit = ctx.spec.rollout.max_prompt_tokens
    if limit and shortest > limit:
        return InvalidInput(
            f"rollout.max_prompt_tokens: every one of the {n} held-out prompts is longer than {limit} tokens (the "
            f"shortest has {shortest}), so none can be evaluated (training skips such prompts as prompt_too_long); "
            f"raise it to at least {shortest}, or hold out shorter prompts"
        )
    return InvalidInput(
        f"dataset: every one of the {n} held-out prompts (the shortest has {shortest} tokens) leaves no room for a "
        f"response in the model's context of {ctx.context_tokens} tokens, so none can be evaluated; hold out shorter "
        "prompts, or serve the model with a longer context"
    )


async def evaluate(
    ctx: RolloutContext, run_id: str, step: int, prompts: list[Prompt], batch_size: int, trainer_version: int
) -> EvalResult:
    """The EvalResult of the current fleet weights on `prompts` but those too long (counted in prompts_too_long);
    InvalidInput when every prompt is too long, Unavailable when no sample was both generated and scored."""
    k = ctx.spec.schedule.eval_samples
    everyone = [_HeldOut(i, p, ctx.encode(ctx.render(p.prompt))) for i, p in enumerate(prompts)]
    held_out = [h for h in everyone if not prompt_too_long(ctx, len(h.ids))]
    too_long = len(everyone) - len(held_out)
    if not held_out:
        raise _nothing_to_evaluate(ctx, everyone)
    if too_long:
        logger.warning(
            "run %s eval at step %d: %d of %d held-out prompts are too long (rollout.max_prompt_tokens %d, context "
            "%d tokens) and are left out, as training skips such prompts",
            run_id,
            step,
            too_long,
            len(everyone),
            ctx.spec.rollout.max_prompt_tokens,
            ctx.context_tokens,
            extra={"run_id": run_id, "step": step},
        )
    per_request = max(1, batch_size // k)  # a request holds about batch_size samples
    batches = [held_out[i : i + per_request] for i in range(0, len(held_out), per_request)]
    if ctx.environment is None:
        per_batch = await gather_cancelling([_evaluate_batch(ctx, run_id, step, batch, k) for batch in batches])
    else:
        # At most a batch of episodes under way: started all at once, every episode's first turn ran before any
        # second one, and their trajectories together passed the router's cache budget, which evicted the
        # episodes waiting for their next turn (a thousand held-out prompts lost a third of their samples).
        under_way = asyncio.Semaphore(batch_size)
        per_batch = await gather_cancelling(
            [_evaluate_episodes(ctx, run_id, step, batch, k, under_way) for batch in batches]
        )
    outcomes = [o for batch in per_batch for o in batch]
    answered = [o.completion for o in outcomes if not o.completion.error]
    if not answered:
        errors = {o.completion.error for o in outcomes}
        raise Unavailable(f"evaluation at step {step} got no response: {'; '.join(sorted(errors))[:500]}")
    failed = [o.error for o in outcomes if o.error]
    if len(failed) == len(outcomes):
        # A hub that scores nothing would otherwise be recorded as a model that answers nothing right.
        raise Unavailable(
            f"evaluation at step {step}: none of the {len(outcomes)} samples could be generated and scored: "
            f"{'; '.join(sorted(set(failed)))[:500]}"
        )
    versions = [c.weight_version for c in answered if c.weight_version is not None]
    solved = {o.prompt_index for o in outcomes if o.correct}
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
        size=len(held_out),
        accuracy=sum(o.correct for o in outcomes) / len(outcomes),
        pass_at_k=len(solved) / len(held_out),
        mean_length=sum(len(c.output_ids) for c in answered) / len(answered),
        truncation_rate=sum(c.finish_reason == FinishReason.FINISH_REASON_LENGTH for c in answered) / len(answered),
        k=k,
        failed=len(failed),
        prompts_too_long=too_long,
    )
