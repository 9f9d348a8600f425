"""`multi_turn`: each of the n samples is an episode in which the model and the run's environment take turns.

    ids = the rendered prompt's tokens
    for turn in 1..max_turns:
        generate from ids through the router, under the sample's trajectory id (a turn a weight
        update aborts is resumed on the new weights under rollout.on_weight_update abort_resume),
        max_new_tokens cut to what the model's context leaves
        ask the environment for a reply to the turns so far (on a thread of the orchestrator's ReplyPool), each
        turn's text as its tokens carry it on (a stop string the engine cut from its text included);
        stop if it has none (or the turn was cut); an environment that raises, or does not reply within the
        pool's time limit, ends the episode as a failed sample
        stop, cut (finish reason length), when the reply would leave no room for another turn
        ids = ids + the tokens the engine generated + the reply's tokens
    read the trajectory back from the router's cache: the Sample's prompt ids, response ids,
    rollout logprobs, loss mask (0 on the environment's tokens) and weight versions; then delete it there

Each turn's prompt extends the previous one by exactly the generated ids, so the router lays the
turns out as one sequence of the tokens the engines produced: nothing is re-tokenised. The last
model turn, as the engine wrote it (as single_turn's response), is what the reward functions score. The
environment's reply is appended as its text's tokens, right after the model's: with a chat model, an
environment writes the chat template's turn markers into its reply itself.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from rlfleet.errors import Internal, RlfleetError
from rlfleet.v1.reward_pb2 import ScoreItem
from rlfleet.v1.samples_pb2 import FinishReason, SampleGroup
from rlfleet_rollout.concurrency import finish, gather_cancelling
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.environment import Environment, ReplyTimeout
from rlfleet_rollout.group_producer import (
    GroupRequest,
    RolloutContext,
    build_sample,
    finish_group,
    generation_room,
    sample_seed,
)
from rlfleet_rollout.partial_rollout import generate_turn_resuming
from rlfleet_rollout.router_client import FORGET_TIMEOUT_S, Completion, sampling_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Episode:
    """One sample's episode; `completion` spans every turn (its error set when it cannot be trained on)."""

    completion: Completion
    loss_mask: tuple[int, ...] = ()
    weight_versions: tuple[int, ...] = ()
    final_turn: str = ""
    """Text of the last model turn: what is scored."""
    turns: int = 0


def turn_seed(seed: int, turn: int) -> int:
    """Sampling seed of turn `turn` of the sample seeded `seed` (a non-negative int32)."""
    return (seed + turn) % 2**31


async def multi_turn(ctx: RolloutContext, request: GroupRequest) -> SampleGroup:
    """The group `request.group_id`: `group_size` seeded episodes of the prompt with the run's environment."""
    env = ctx.environment
    if env is None:
        raise Internal("multi_turn needs rollout.multi_turn.environment, which resolve() fills in")
    n = ctx.spec.rollout.group_size
    prompt = request.prompt
    text = ctx.render(prompt.prompt)
    prompt_ids = ctx.encode(text)
    seeds = [sample_seed(ctx.spec.dataset.seed, request.position, j) for j in range(n)]
    # Unique per attempt (a restarted orchestrator may re-produce the group while the old episode runs);
    # no "/" so the id is one path segment of the router's /trajectories/{id}.
    attempt = uuid.uuid4().hex[:8]
    base_id = request.group_id.replace("/", ":")
    trajectory_ids = [f"{base_id}:{j}@{attempt}" for j in range(n)]
    sampling = sampling_body(ctx.spec.rollout.sampling)

    async def play(j: int) -> Episode:
        if ctx.episodes is None:
            return await run_episode(ctx, env, prompt, prompt_ids, sampling, seeds[j], trajectory_ids[j])
        # Held for the whole episode: the episodes under way finish their turns before new ones start theirs.
        async with ctx.episodes:
            return await run_episode(ctx, env, prompt, prompt_ids, sampling, seeds[j], trajectory_ids[j])

    episodes = await gather_cancelling([play(j) for j in range(n)])
    items = [
        ScoreItem(id=str(j), prompt=prompt.prompt, response=e.final_turn, label=prompt.answer, metadata=prompt.metadata)
        for j, e in enumerate(episodes)
        if not e.completion.error
    ]
    results = {r.id: r for r in await ctx.score(items)}
    samples = []
    for j, episode in enumerate(episodes):
        completion = episode.completion
        sample = build_sample(
            f"{request.group_id}/{j}",
            j,
            prompt_ids,
            text,
            completion,
            ctx.tokenizer.decode(list(completion.output_ids), skip_special_tokens=True),
            results.get(str(j)),
            request.fallback_version,
            loss_mask=episode.loss_mask if not completion.error else None,
            weight_versions=episode.weight_versions,
        )
        # The id the episode's turns went to the router under (which deleted it once read): its logs name it.
        sample.metadata["trajectory_id"] = trajectory_ids[j]
        sample.metadata["turns"] = str(episode.turns)
        if not completion.error:
            ctx.metrics.episode_turns.observe(episode.turns)
        samples.append(sample)
    return finish_group(ctx, request, samples, seeds)


async def run_episode(
    ctx: RolloutContext,
    env: Environment,
    prompt: Prompt,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    seed: int | None,
    trajectory_id: str,
) -> Episode:
    """One episode of `prompt` under `trajectory_id`, with SGLang `sampling` params (seeded per turn unless
    `seed` is None, e.g. greedy evaluation). However it ends, the router's copy of its trajectory is deleted
    then, so an episode that failed does not crowd the ones under way out of the router's cache either; one
    cancelled (its group's wave failed) too, within FORGET_TIMEOUT_S, through repeated cancellations."""
    try:
        return await _play_episode(ctx, env, prompt, prompt_ids, sampling, seed, trajectory_id)
    finally:
        try:
            await finish(ctx.router.forget_trajectory(trajectory_id), within_s=FORGET_TIMEOUT_S)
        except (RlfleetError, TimeoutError) as exc:  # the router evicts it in time; the sample has what it needs
            logger.warning("could not delete trajectory %s at the router: %s", trajectory_id, exc)


async def _play_episode(
    ctx: RolloutContext,
    env: Environment,
    prompt: Prompt,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    seed: int | None,
    trajectory_id: str,
) -> Episode:
    replies = ctx.replies
    if replies is None:
        raise Internal("an episode needs the orchestrator's ReplyPool (RolloutContext.replies)")
    max_turns = ctx.spec.rollout.multi_turn.max_turns
    ids = list(prompt_ids)
    texts: list[str] = []
    last = first = Completion()
    out_of_context = False
    for turn in range(max_turns):
        params = sampling if seed is None else {**sampling, "sampling_seed": turn_seed(seed, turn)}
        try:
            params = ctx.within_context(params, len(ids))
            last = await generate_turn_resuming(ctx, ids, params, f"{trajectory_id}/{turn}", trajectory_id)
        except RlfleetError as exc:
            return Episode(Completion(error=f"turn {turn + 1}: generation failed: {exc}"), turns=turn + 1)
        if last.error:
            # Only this turn's tokens came back: a sample of them alone would misstate the episode.
            return Episode(Completion(finish_reason=last.finish_reason, error=last.error), turns=turn + 1)
        first = first if turn else last
        texts.append(conversation_text(ctx, last))
        if last.finish_reason == FinishReason.FINISH_REASON_LENGTH or turn + 1 == max_turns:
            break
        try:
            # In a thread: a slow tool would otherwise hold up every other generation of the orchestrator.
            reply = await replies.reply(env, prompt, texts)
            if reply is not None and not isinstance(reply, str):
                raise TypeError(f"reply returned a {type(reply).__name__}, not a str or None")
        except ReplyTimeout as exc:
            return Episode(Completion(error=f"turn {turn + 1}: {exc}"), turns=turn + 1)
        except Exception as exc:  # noqa: BLE001 - an environment's fault ends its episode, not the run
            error = f"turn {turn + 1}: environment failed: {type(exc).__name__}: {exc}"
            return Episode(Completion(error=error), turns=turn + 1)
        if reply is None:
            break
        reply_ids = list(ctx.tokenizer.encode(reply, add_special_tokens=False).ids)
        next_prompt = len(ids) + len(last.output_ids) + len(reply_ids)
        if ctx.context_tokens and generation_room(ctx.context_tokens, next_prompt) < 1:
            # No room for another turn: the episode ends here, cut as a generation cut at max_new_tokens is.
            out_of_context = True
            break
        ids += list(last.output_ids) + reply_ids
    turns = len(texts)
    try:
        trajectory = await ctx.router.trajectory(trajectory_id)
    except RlfleetError as exc:
        error = f"reading trajectory {trajectory_id} from the router failed: {exc}"
        return Episode(Completion(error=error), turns=turns)
    if tuple(trajectory.prompt_ids) != tuple(prompt_ids):
        # The router dropped the trajectory between turns (evicted as stale or over its budget, or restarted):
        # a later turn began a new one, whose prompt holds the earlier turns with nothing to tell them apart.
        return Episode(
            Completion(
                error=f"the router's trajectory {trajectory_id} does not start at the episode's prompt "
                f"({len(trajectory.prompt_ids)} prompt tokens, not {len(prompt_ids)}): it lost the earlier turns"
            ),
            turns=turns,
        )
    if trajectory.prompt_ids + trajectory.response_ids != (*ids, *last.output_ids):
        error = f"the router's trajectory {trajectory_id} differs from the episode's tokens"
        return Episode(Completion(error=error), turns=turns)
    versions = tuple(v for v in trajectory.weight_versions if v is not None)
    whole = Completion(
        output_ids=trajectory.response_ids,
        logprobs=trajectory.logprobs,
        finish_reason=FinishReason.FINISH_REASON_LENGTH if out_of_context else last.finish_reason,
        weight_version=versions[-1] if versions else None,
        cached_tokens=first.cached_tokens,
    )
    return Episode(whole, trajectory.loss_mask, versions, ctx.response_text(last), turns)


def conversation_text(ctx: RolloutContext, completion: Completion) -> str:
    """A model turn's text as the conversation goes on with it, which is what its environment reads: the engine's
    text with the stop string it cut from the end. The turn's tokens keep that stop string (the next turn's prompt
    holds it), so without it an environment did not see a call the stop string closes (`stop: ["]"]` with the
    calculator: `[12+7` is no call, and the episode ended on it). When the tokens decoded here do not begin with
    the engine's text (an engine that decodes otherwise), the engine's text stands."""
    text = ctx.response_text(completion)
    decoded = ctx.tokenizer.decode(list(completion.output_ids), skip_special_tokens=True)
    return decoded if decoded.startswith(text) else text
