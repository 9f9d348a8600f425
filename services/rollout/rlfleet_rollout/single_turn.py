"""`single_turn`: n seeded samples of one prompt in one /generate request, each scored at the reward hub.

Under rollout.on_weight_update "abort_resume", samples a weight update aborted are resumed on the
new weights (`partial_rollout`)."""

from __future__ import annotations

import logging
import uuid

from rlfleet.errors import RlfleetError
from rlfleet.v1.reward_pb2 import ScoreItem
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_rollout.group_producer import (
    GroupRequest,
    RolloutContext,
    build_sample,
    finish_group,
    sample_seed,
    seeded_sampling,
)
from rlfleet_rollout.partial_rollout import generate_resuming
from rlfleet_rollout.router_client import Completion, sampling_body

logger = logging.getLogger(__name__)


async def single_turn(ctx: RolloutContext, request: GroupRequest) -> SampleGroup:
    """The group `request.group_id`: `group_size` seeded samples of the prompt, scored."""
    ro = ctx.spec.rollout
    n = ro.group_size
    prompt = request.prompt
    text = ctx.render(prompt.prompt)
    prompt_ids = ctx.encode(text)
    sample_ids = [f"{request.group_id}/{j}" for j in range(n)]
    seeds = [sample_seed(ctx.spec.dataset.seed, request.position, j) for j in range(n)]
    # Request ids must be unique among requests in flight, and a restarted orchestrator may re-produce
    # a group while its predecessor's request still runs: the suffix keeps them apart.
    attempt = uuid.uuid4().hex[:8]
    rids = [f"{sample_id}@{attempt}" for sample_id in sample_ids]
    try:
        sampling = seeded_sampling(ctx.within_context(sampling_body(ro.sampling), len(prompt_ids)), seeds)
        completions = await generate_resuming(ctx, [prompt_ids] * n, sampling, rids)
    except RlfleetError as exc:
        logger.warning("generation of group %s failed: %s", request.group_id, exc, extra={"run_id": request.run_id})
        completions = [Completion(error=f"generation failed: {exc}")] * n
    texts = [ctx.response_text(c) if not c.error else "" for c in completions]
    items = [
        ScoreItem(id=str(j), prompt=prompt.prompt, response=texts[j], label=prompt.answer, metadata=prompt.metadata)
        for j, c in enumerate(completions)
        if not c.error
    ]
    results = {r.id: r for r in await ctx.score(items)}
    samples = [
        build_sample(sample_ids[j], j, prompt_ids, text, c, texts[j], results.get(str(j)), request.fallback_version)
        for j, c in enumerate(completions)
    ]
    return finish_group(ctx, request, samples, seeds)
