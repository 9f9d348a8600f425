"""Partial rollouts: generations that a weight update aborted, resumed on the new weights
(`rollout.on_weight_update: abort_resume`).

The trainer's weight load asks every engine to abort what it is generating
(`abort_all_requests`); each aborted completion comes back with the tokens and logprobs it had
produced under the old version. Such a completion is re-submitted as prompt + partial response
with the remaining `max_new_tokens` (and, when seeded, a seed of its own), and the two halves are
joined: the Sample's response is the concatenation, its logprobs those each half was sampled with,
and its `weight_versions` both versions, oldest first, so the staleness rule and the trainer's
off-policy correction see the old part for what it is. A stop string the cut splits (begun in the
first half, completed in the second) ends the joined generation where the engine would have ended
it had it made both halves.

A multi-turn episode's turn is resumed the same way under its trajectory id: the router then holds
the aborted half and its continuation as two turns with nothing between them, which lay out as the
same tokens, all in the loss. Such a turn keeps every token the engines made, as its trajectory
does, so there a stop string split by the cut is not matched.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rlfleet.errors import RlfleetError
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.router_client import Completion

if TYPE_CHECKING:
    from rlfleet_rollout.group_producer import RolloutContext

logger = logging.getLogger(__name__)

# Weight updates come once per training step, far apart next to one generation: a completion aborted
# more often than this is failing for another reason, and is recorded as aborted.
MAX_RESUMES = 4
_REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of a character not all there


def join(head: Completion, tail: Completion, decode: Callable[[list[int]], str]) -> Completion:
    """`head` (aborted) followed by `tail` (its continuation): the tail decides how the whole ended.

    The text is the engine's text of `head`, then the tail's tokens decoded after the head's (`decode`), less
    what the engine cut from the tail's end (a stop string): decoded alone, a SentencePiece tail loses the
    space its first token begins with, and "is 42" would follow "the answer" as "the answeris 42". A head cut
    between the byte tokens of one character ends in U+FFFD, as does the tail decoded alone: the character is
    whole only in the tokens decoded together, so the head's text is taken without it.
    """
    versions = list(head.weight_versions)
    versions += [v for v in tail.weight_versions if not versions or v != versions[-1]]
    return Completion(
        output_ids=head.output_ids + tail.output_ids,
        logprobs=head.logprobs + tail.logprobs,
        text=_head_text(head, decode) + _tail_text(head, tail, decode),
        finish_reason=tail.finish_reason,
        weight_version=tail.weight_version,
        weight_versions=tuple(versions),
        cached_tokens=head.cached_tokens,
        error=tail.error,
    )


def _head_text(head: Completion, decode: Callable[[list[int]], str]) -> str:
    """The head's text less the replacement characters a character cut at its end decodes to."""
    return head.response_text(decode).rstrip(_REPLACEMENT)


def _tail_text(head: Completion, tail: Completion, decode: Callable[[list[int]], str]) -> str:
    alone = decode(list(tail.output_ids))
    text = tail.response_text(decode)
    before = decode(list(head.output_ids)).rstrip(_REPLACEMENT)
    together = decode(list(head.output_ids + tail.output_ids))
    in_context = together[len(before) :]
    trimmed = alone[len(text) :]  # what the engine cut from the end (a matched stop string)
    if not (alone.startswith(text) and together.startswith(before) and in_context.endswith(trimmed)):
        return text  # the engine's text is not this tokenizer's decode of its tokens: keep it as it is
    return in_context[: len(in_context) - len(trimmed)]


def stop_across_the_cut(
    whole: Completion, head: Completion, stops: Sequence[str], decode: Callable[[list[int]], str]
) -> Completion:
    """`whole` (`head` joined with its continuation) cut at the first stop string that begins in `head`'s
    text and ends after it, as the engine cuts a generation: at the token that completes a match (two completed
    by the same token: the one listed first), the text up to where that match begins, finish reason stop.
    Unchanged if none."""
    cut = len(_head_text(head, decode))
    text = whole.response_text(decode)
    untrimmed = decode(list(whole.output_ids))
    if untrimmed.startswith(text):
        # The continuation's engine cut a stop string of its own from the end, which may have completed the one
        # the cut split: the search reads what it cut too.
        text = untrimmed
    ids = list(whole.output_ids)
    hits = []  # (tokens up to the one completing the match, the stop's place in the list, where the match begins)
    for place, stop in enumerate(stops):
        start = text.find(stop, max(0, cut - len(stop) + 1))
        if 0 <= start < cut < start + len(stop):
            end = start + len(stop)
            count = next(
                (k for k in range(len(head.output_ids) + 1, len(ids) + 1) if len(decode(ids[:k])) >= end), len(ids)
            )
            hits.append((count, place, start))
    if not hits:
        return whole
    count, _, start = min(hits)
    return Completion(
        output_ids=tuple(ids[:count]),
        logprobs=whole.logprobs[:count],
        text=text[:start],
        finish_reason=FinishReason.FINISH_REASON_STOP,
        weight_version=whole.weight_version,
        weight_versions=whole.weight_versions,
        cached_tokens=whole.cached_tokens,
    )


def resumed(head: Completion, tail: Completion, sampling: dict[str, Any], ctx: RolloutContext) -> Completion:
    """`head` joined with its continuation `tail`, ended at a stop string the cut split, if any."""
    stops = sampling.get("stop") or ()
    whole = join(head, tail, _decoder(ctx))
    if not stops:
        return whole
    return stop_across_the_cut(whole, head, stops, _decoder(ctx))


def _decoder(ctx: RolloutContext) -> Callable[[list[int]], str]:
    """Token ids to text as the engines write it (special tokens left out)."""
    return lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True)


def _remaining_tokens(completion: Completion, sampling: dict[str, Any]) -> int:
    return int(sampling["max_new_tokens"]) - len(completion.output_ids)


def continued_seed(seed: int, produced: int) -> int:
    """The sampling seed of a continuation after `produced` tokens of a generation seeded `seed` (a non-negative
    int32): as reproducible as the first, and its own."""
    digest = hashlib.sha256(f"{seed}+{produced}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def _continuation(completion: Completion, sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling params of `completion`'s continuation: the tokens still allowed, and a seed of its own. Under
    the aborted part's seed, an engine that seeds a request's generator as it starts (rlfleet-engine) drew the same
    random numbers again from the continuation's first token on: token k + j repeated token j's draw."""
    params = {**sampling, "max_new_tokens": _remaining_tokens(completion, sampling)}
    if (seed := sampling.get("sampling_seed")) is not None:
        params["sampling_seed"] = continued_seed(int(seed), len(completion.output_ids))
    return params


async def generate_turn_resuming(
    ctx: RolloutContext, prompt: list[int], sampling: dict[str, Any], rid: str, trajectory_id: str
) -> Completion:
    """One turn of a trajectory, as `ctx.generate_turn`; under abort_resume an aborted turn is resumed (bounded)."""
    completion = await ctx.generate_turn(prompt, sampling, rid, trajectory_id)
    if ctx.spec.rollout.on_weight_update != "abort_resume":
        return completion
    for attempt in range(1, MAX_RESUMES + 1):
        remaining = _remaining_tokens(completion, sampling)
        if completion.finish_reason != FinishReason.FINISH_REASON_ABORT or remaining <= 0:
            break
        ctx.metrics.resumed_generations.inc()
        tail = await ctx.generate_turn(
            prompt + list(completion.output_ids),
            _continuation(completion, sampling),
            f"{rid}+resume{attempt}",
            trajectory_id,
        )
        completion = join(completion, tail, _decoder(ctx))
    return completion


async def generate_resuming(
    ctx: RolloutContext, prompts: list[list[int]], sampling: list[dict[str, Any]], rids: list[str]
) -> list[Completion]:
    """One completion per prompt, as `ctx.generate`; under abort_resume, aborted ones are resumed (bounded)."""
    completions = await ctx.generate(prompts, sampling, rids)
    if ctx.spec.rollout.on_weight_update != "abort_resume":
        return completions
    for attempt in range(1, MAX_RESUMES + 1):
        todo = [
            i
            for i, c in enumerate(completions)
            if c.finish_reason == FinishReason.FINISH_REASON_ABORT and _remaining_tokens(c, sampling[i]) > 0
        ]
        if not todo:
            break
        ctx.metrics.resumed_generations.inc(len(todo))
        try:
            tails = await ctx.generate(
                [prompts[i] + list(completions[i].output_ids) for i in todo],
                [_continuation(completions[i], sampling[i]) for i in todo],
                [f"{rids[i]}+resume{attempt}" for i in todo],
            )
        except RlfleetError as exc:
            # The partial completions stay as they are: aborted samples, kept out of the loss.
            logger.warning("resuming %d aborted generations failed: %s", len(todo), exc)
            break
        for i, tail in zip(todo, tails, strict=True):
            completions[i] = resumed(completions[i], tail, sampling[i], ctx)
    return completions
