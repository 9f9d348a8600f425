"""Producing one SampleGroup: n samples of one prompt from the router, scored at the reward hub.

A failure confined to a group (the router or the hub failing that request, an engine aborting a
sample) marks the affected samples FAILED or ABORTED with reward 0 instead of failing the run;
the run loop decides whether a whole step of failures is fatal.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from rlfleet.errors import InvalidInput, RlfleetError
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import FinishReason, Sample, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.router_client import Completion, RouterClient, sampling_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutContext:
    """What producing samples for one run needs: clients, the run's tokenizer and spec, a concurrency bound."""

    router: RouterClient
    reward: RewardClient
    tokenizer: Tokenizer
    spec: RunSpec
    limit: asyncio.Semaphore
    metrics: RolloutMetrics
    render: Callable[[str], str] = str
    """Prompt -> text the model sees (the tokenizer's chat template when the dataset asks for it)."""

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt).ids)

    def response_text(self, completion: Completion) -> str:
        return completion.text or self.tokenizer.decode(list(completion.output_ids), skip_special_tokens=True)

    async def generate(
        self, prompts: list[list[int]], sampling: dict[str, Any] | list[dict[str, Any]], rids: list[str]
    ) -> list[Completion]:
        async with self.limit:
            started = time.monotonic()
            try:
                return await self.router.generate(prompts, sampling, rids)
            finally:
                self.metrics.generate_seconds.observe(time.monotonic() - started)

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """Scores `items`; a hub failure yields ERROR results (a 4xx means the spec is wrong: raised)."""
        if not items:
            return []
        try:
            return await self.reward.score(self.spec.reward, items)
        except InvalidInput:
            raise
        except RlfleetError as exc:
            error = f"scoring failed: {exc}"
            return [ScoreResult(id=item.id, status=ScoreStatus.SCORE_STATUS_ERROR, error=error) for item in items]


def full_marks(reward: RewardSpec) -> float:
    """The score of a fully correct response: every term scoring 1, weighted."""
    return sum(term.weight for term in reward.terms) - 1e-6


def build_sample(
    sample_id: str,
    index: int,
    prompt_ids: list[int],
    prompt_text: str,
    completion: Completion,
    response_text: str,
    result: ScoreResult | None,
    fallback_version: int,
) -> Sample:
    """One Sample from an engine completion and its score (None when the completion was not scored)."""
    version = completion.weight_version if completion.weight_version is not None else fallback_version
    sample = Sample(
        sample_id=sample_id,
        index=index,
        prompt_token_ids=prompt_ids,
        response_token_ids=completion.output_ids,
        rollout_logprobs=completion.logprobs,
        loss_mask=[1] * len(completion.output_ids),
        prompt_text=prompt_text,
        response_text=response_text,
        weight_versions=[version],
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


async def produce_group(
    ctx: RolloutContext, run_id: str, group_id: str, position: int, prompt: Prompt, fallback_version: int
) -> SampleGroup:
    """The group `group_id`: `group_size` seeded samples of the prompt at `position`, scored."""
    ro = ctx.spec.rollout
    n = ro.group_size
    text = ctx.render(prompt.prompt)
    prompt_ids = ctx.encode(text)
    sample_ids = [f"{group_id}/{j}" for j in range(n)]
    seeds = [sample_seed(ctx.spec.dataset.seed, position, j) for j in range(n)]
    # Request ids must be unique among requests in flight, and a restarted orchestrator may re-produce
    # a group while its predecessor's request still runs: the suffix keeps them apart.
    attempt = uuid.uuid4().hex[:8]
    rids = [f"{sample_id}@{attempt}" for sample_id in sample_ids]
    try:
        completions = await ctx.generate([prompt_ids] * n, seeded_sampling(sampling_body(ro.sampling), seeds), rids)
    except RlfleetError as exc:
        logger.warning("generation of group %s failed: %s", group_id, exc, extra={"run_id": run_id})
        completions = [Completion(error=f"generation failed: {exc}")] * n
    texts = [ctx.response_text(c) if not c.error else "" for c in completions]
    items = [
        ScoreItem(id=str(j), prompt=prompt.prompt, response=texts[j], label=prompt.answer, metadata=prompt.metadata)
        for j, c in enumerate(completions)
        if not c.error
    ]
    results = {r.id: r for r in await ctx.score(items)}
    samples = [
        build_sample(sample_ids[j], j, prompt_ids, text, c, texts[j], results.get(str(j)), fallback_version)
        for j, c in enumerate(completions)
    ]
    for sample, seed in zip(samples, seeds, strict=True):
        sample.seed = seed
        apply_truncation_rule(sample, ro.truncated)
        ctx.metrics.count_sample(sample.status)
    group = SampleGroup(
        group_id=group_id,
        run_id=run_id,
        prompt_id=f"train/{position}",
        label=prompt.answer,
        samples=samples,
        weight=1.0,
        metadata=prompt.metadata,
    )
    group.created_at.GetCurrentTime()
    return group


def rename_group(group: SampleGroup, group_id: str) -> None:
    """Gives an accepted candidate its slot's id (the stream deduplicates by it), samples included."""
    group.group_id = group_id
    for sample in group.samples:
        sample.sample_id = f"{group_id}/{sample.index}"
