"""What every rollout function shares: the run's context, turning completions into scored Samples, and
finishing a SampleGroup (seeds, the truncation rule, metrics).

A failure confined to a group (the router or the hub failing that request, an engine aborting a
sample) marks the affected samples FAILED or ABORTED with reward 0 instead of failing the run;
the run loop decides whether a whole step of failures is fatal.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from rlfleet.errors import Conflict, InvalidInput, RlfleetError
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import FinishReason, Sample, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.router_client import Completion, RouterClient

if TYPE_CHECKING:
    from rlfleet_rollout.environment import Environment, ReplyPool
    from rlfleet_rollout.rollout_function import RolloutFunction


def generation_room(context_tokens: int, prompt_tokens: int) -> int:
    """The largest max_new_tokens an engine takes after `prompt_tokens`: SGLang refuses (400) a prompt and a
    max_new_tokens that together reach the context length, not only those past it."""
    return context_tokens - prompt_tokens - 1


@dataclass(frozen=True)
class GroupRequest:
    """One group to produce: the prompt at `position` of the run's data, under the id `group_id`."""

    run_id: str
    group_id: str
    position: int
    prompt: Prompt
    fallback_version: int
    """Weight version recorded when an engine does not report its own."""


@dataclass(frozen=True)
class RolloutContext:
    """What producing samples for one run needs: clients, the run's tokenizer and spec, a concurrency bound."""

    router: RouterClient
    reward: RewardClient
    tokenizer: Tokenizer
    spec: RunSpec
    limit: asyncio.Semaphore
    """Generate requests in flight."""
    metrics: RolloutMetrics
    rollout: RolloutFunction
    """The run's rollout.function."""
    render: Callable[[str], str] = str
    """Prompt -> text the model sees (the tokenizer's chat template when the dataset asks for it)."""
    environment: Environment | None = None
    """The run's rollout.multi_turn.environment, when it names one."""
    replies: ReplyPool | None = None
    """The orchestrator's threads for environment replies, with their time limit (multi_turn needs them)."""
    episodes: asyncio.Semaphore | None = None
    """multi_turn episodes of the run's training under way (evaluation bounds its own)."""
    context_tokens: int = 0
    """The model's context length (config.json); 0: unknown, max_new_tokens is sent as the spec says."""

    def encode(self, prompt: str) -> list[int]:
        """The ids of a prompt as `render` gave it. A chat template writes its own special tokens
        ({{ bos_token }}), so a rendered prompt is encoded without the tokenizer's (as transformers'
        apply_chat_template does: a BOS post-processor would add a second one); a raw prompt gets them."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=self.render is str).ids)

    def within_context(self, sampling: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        """`sampling` with max_new_tokens cut to what the context leaves after `prompt_tokens`: an engine refuses
        a request whose prompt and max_new_tokens together exceed it (SGLang answers 400), which failed the whole
        sample; cut, the generation stops at the context with finish reason length. InvalidInput when the
        prompt leaves no room."""
        if not self.context_tokens:
            return sampling
        room = generation_room(self.context_tokens, prompt_tokens)
        if room < 1:
            raise InvalidInput(
                f"a prompt of {prompt_tokens} tokens leaves no room in the model's context of {self.context_tokens}"
            )
        return {**sampling, "max_new_tokens": min(int(sampling["max_new_tokens"]), room)}

    def response_text(self, completion: Completion) -> str:
        """What the engine wrote; its tokens decoded only when it sent no text (an empty text stands: decoded,
        a response that was only a stop string would be scored as that stop string)."""
        return completion.response_text(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    async def generate(
        self, prompts: list[list[int]], sampling: dict[str, Any] | list[dict[str, Any]], rids: list[str]
    ) -> list[Completion]:
        async with self.limit:
            started = time.monotonic()
            try:
                return await self.router.generate(prompts, sampling, rids)
            finally:
                self.metrics.generate_seconds.observe(time.monotonic() - started)

    async def generate_turn(
        self, prompt: list[int], sampling: dict[str, Any], rid: str, trajectory_id: str
    ) -> Completion:
        async with self.limit:
            started = time.monotonic()
            try:
                return await self.router.generate_turn(prompt, sampling, rid, trajectory_id)
            finally:
                self.metrics.generate_seconds.observe(time.monotonic() - started)

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """Scores `items`; a hub failure yields ERROR results, but the hub refusing the orchestrator (a Conflict: a
        4xx from a proxy or a hub without /score) is raised, failing the run: every later call would get the same."""
        if not items:
            return []
        try:
            return await self.reward.score(self.spec.reward, items)
        except Conflict:
            raise
        except RlfleetError as exc:
            error = f"scoring failed: {exc}"
            return [ScoreResult(id=item.id, status=ScoreStatus.SCORE_STATUS_ERROR, error=error) for item in items]


def prompt_too_long(ctx: RolloutContext, prompt_tokens: int) -> bool:
    """Whether a prompt of `prompt_tokens` is skipped: longer than rollout.max_prompt_tokens, or leaving no room for a
    response in the model's context (every sample of it would fail, as if the fleet were down). Training filters its
    group as "prompt_too_long"; evaluation leaves it out and counts it (EvalResult.prompts_too_long)."""
    limit = ctx.spec.rollout.max_prompt_tokens
    if limit and prompt_tokens > limit:
        return True
    return bool(ctx.context_tokens) and generation_room(ctx.context_tokens, prompt_tokens) < 1


def full_marks(reward: RewardSpec) -> float:
    """The least score of a fully correct response, as the hub weighs terms (the weighted sum of their scores):
    every positive-weight term at 1 and every penalty (a negative weight) at 0. Summing every weight would put a
    penalty's weight below the bar, and a wrong answer that earned no penalty would pass."""
    return sum(max(term.weight, 0.0) for term in reward.terms) - 1e-6


def build_sample(
    sample_id: str,
    index: int,
    prompt_ids: list[int],
    prompt_text: str,
    completion: Completion,
    response_text: str,
    result: ScoreResult | None,
    fallback_version: int,
    *,
    loss_mask: Sequence[int] | None = None,
    weight_versions: Sequence[int] = (),
) -> Sample:
    """One Sample from an engine completion and its score (None when the completion was not scored).

    `loss_mask` defaults to every response token; `weight_versions` to the versions the completion
    reports (every one that produced a token), else its engine's version, else `fallback_version`.
    """
    version = completion.weight_version if completion.weight_version is not None else fallback_version
    sample = Sample(
        sample_id=sample_id,
        index=index,
        prompt_token_ids=prompt_ids,
        response_token_ids=completion.output_ids,
        rollout_logprobs=completion.logprobs,
        loss_mask=[1] * len(completion.output_ids) if loss_mask is None else loss_mask,
        prompt_text=prompt_text,
        response_text=response_text,
        weight_versions=weight_versions or completion.weight_versions or [version],
        finish_reason=completion.finish_reason,
        cached_prompt_tokens=completion.cached_tokens,
    )
    if completion.error:
        aborted = completion.finish_reason == FinishReason.FINISH_REASON_ABORT
        sample.status = SampleStatus.SAMPLE_STATUS_ABORTED if aborted else SampleStatus.SAMPLE_STATUS_FAILED
        sample.error = completion.error
    elif result is None:
        sample.status = SampleStatus.SAMPLE_STATUS_FAILED
        sample.error = "the reward hub returned no result for this sample"
    elif result.status != ScoreStatus.SCORE_STATUS_OK:
        sample.status = SampleStatus.SAMPLE_STATUS_FAILED
        sample.error = result.error or f"scoring ended with {ScoreStatus.Name(result.status)}"
    else:
        sample.reward = result.score
        sample.reward_components.update(result.components)
        truncated = completion.finish_reason == FinishReason.FINISH_REASON_LENGTH
        sample.status = SampleStatus.SAMPLE_STATUS_TRUNCATED if truncated else SampleStatus.SAMPLE_STATUS_OK
    return sample


def sample_seed(dataset_seed: int, position: int, index: int) -> int:
    """The sampling seed of sample `index` of the prompt at `position`: the same spec gives the same seeds."""
    digest = hashlib.sha256(f"{dataset_seed}/{position}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # a non-negative int32, which every engine accepts


def seeded_sampling(base: dict[str, Any], seeds: list[int]) -> list[dict[str, Any]]:
    """One `sampling_params` per prompt of a batch, each with its seed under SGLang's name `sampling_seed`."""
    return [{**base, "sampling_seed": seed} for seed in seeds]


def apply_truncation_rule(sample: Sample, rule: str) -> None:
    """rollout.truncated: "zero_reward" takes a truncated sample's reward, "mask" keeps it out of the loss."""
    if sample.status != SampleStatus.SAMPLE_STATUS_TRUNCATED:
        return
    if rule == "zero_reward":
        sample.reward = 0.0
    elif rule == "mask":
        sample.loss_mask[:] = [0] * len(sample.loss_mask)


def finish_group(ctx: RolloutContext, request: GroupRequest, samples: list[Sample], seeds: list[int]) -> SampleGroup:
    """The SampleGroup of `samples` (seeded, the run's truncation rule applied, counted in the metrics)."""
    for sample, seed in zip(samples, seeds, strict=True):
        sample.seed = seed
        apply_truncation_rule(sample, ctx.spec.rollout.truncated)
        ctx.metrics.count_sample(sample.status)
    group = SampleGroup(
        group_id=request.group_id,
        run_id=request.run_id,
        prompt_id=f"train/{request.position}",
        label=request.prompt.answer,
        samples=samples,
        weight=1.0,
        metadata=request.prompt.metadata,
    )
    group.created_at.GetCurrentTime()
    return group


def rename_group(group: SampleGroup, group_id: str) -> None:
    """Gives an accepted candidate its slot's id (the stream deduplicates by it), samples included."""
    group.group_id = group_id
    for sample in group.samples:
        sample.sample_id = f"{group_id}/{sample.index}"
