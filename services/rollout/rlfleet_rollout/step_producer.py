"""Producing one training step: exactly groups_per_step groups that pass the run's filters.

    send oversample x groups_per_step prompts (from the step's start position, in order)
    each scored group is dropped if its prompt is too long, a filter names it, or it is stale
    (more than max_staleness versions behind the step) under stale_groups "drop"
    accepted groups fill the step's slots in position order; extras are dropped as "surplus"
    while slots remain empty, send as many fresh prompts as there are empty slots
    (bounded by max_prompts_per_step: past it the run fails, naming the field)
    a wave without a usable sample fails the run (Unavailable: the fleet is down) when no earlier wave of
    the step gave one, or the wave before it gave none either

Slot i of step s is the group `<run>/<s>/<i>`, so the stream holds at most groups_per_step groups
per step even when a restarted orchestrator re-produces a step; a re-produced step whose slots were
recorded (run_data.DataPosition) fills only the slots the stream lacks, each with its recorded prompt
(refill_step), generated once more when it gave no usable sample.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlfleet.errors import ResourceExhausted, Unavailable
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_rollout.concurrency import gather_cancelling
from rlfleet_rollout.group_filters import UNUSABLE, FilterRegistry, usable_rewards
from rlfleet_rollout.group_producer import GroupRequest, RolloutContext, prompt_too_long, rename_group
from rlfleet_rollout.run_data import RunData

logger = logging.getLogger(__name__)

# Why a group is dropped besides the run's filters (each filter's name is its reason).
STEP_REASONS = ("prompt_too_long", "stale", "surplus")
# Generations of a re-produced step's slot before one with no usable sample fails the run: its prompt is fixed, so
# a group lost to one passing fault (an engine restarting, one reward call failing) cannot be filtered and
# replaced as in a first production, and failed the run.
REFILL_ATTEMPTS = 2


@dataclass
class StepOutcome:
    groups: list[SampleGroup]
    end: int
    """Position of the first prompt the step did not take."""
    slots: list[int] = field(default_factory=list)
    """Position of the prompt of each group, slot by slot."""
    filtered: Counter[str] = field(default_factory=Counter)
    downweighted: int = 0
    rewards: list[float] = field(default_factory=list)
    """Reward of every sample generated and scored for the step, filtered groups' too."""


def staleness(group: SampleGroup, step: int) -> int:
    """How many versions the oldest usable sample of `group` lags behind `step` (0 if none is usable)."""
    versions = [min(s.weight_versions) for s in group.samples if s.status not in UNUSABLE and s.weight_versions]
    return max(0, step - min(versions)) if versions else 0


def stale_rule(group: SampleGroup, step: int, max_staleness: int, mode: str, weight: float) -> str | None:
    """Applies rollout.stale_groups: "stale" when the group must be dropped; down-weights it in place otherwise."""
    if staleness(group, step) <= max_staleness:
        return None
    if mode == "drop":
        return "stale"
    group.weight = weight
    return None


async def produce_step(
    ctx: RolloutContext,
    data: RunData,
    filters: FilterRegistry,
    run_id: str,
    step: int,
    start: int,
    fallback_version: int,
) -> StepOutcome:
    ro = ctx.spec.rollout
    want = ro.groups_per_step
    limit = start + ro.max_prompts_per_step
    outcome = StepOutcome(groups=[], end=start)
    batch = first_wave = math.ceil(ro.oversample * want)
    failing = 0  # prompts of the step's last waves that gave no usable sample, in a row
    while len(outcome.groups) < want:
        take = min(batch, limit - outcome.end)
        if take <= 0:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.filtered.items()))
            raise ResourceExhausted(
                f"rollout.max_prompts_per_step: step {step} took {ro.max_prompts_per_step} prompts and only "
                f"{len(outcome.groups)} of {want} groups passed ({reasons}); raise it, raise rollout.oversample, "
                "or relax rollout.filters"
            )
        positions = list(range(outcome.end, outcome.end + take))
        outcome.end += take
        candidates = await gather_cancelling(
            [_candidate(ctx, run_id, step, p, data, fallback_version) for p in positions]
        )
        generated = [g for g in candidates if g is not None]
        wave = [s for g in generated for s in g.samples]
        if wave and all(s.status in UNUSABLE for s in wave):
            # A refill wave is often a prompt or two, and a prompt that cannot be scored is the filters' to drop: a
            # reward function failing on a third of the prompts fails two one-prompt waves in a row one time in nine.
            # A fleet that is down fails every wave: the step fails at once when no wave of it has given a usable
            # sample yet, else once as many prompts in a row as its first wave took gave none, rather than consume
            # the dataset wave after wave up to max_prompts_per_step.
            failing += len(generated)
            if failing >= first_wave or not outcome.rewards:
                raise Unavailable(
                    f"step {step}: no sample of {failing} prompts in a row could be generated and scored "
                    f"(first error: {wave[0].error})"
                )
        elif wave:
            failing = 0
        outcome.rewards += [r for g in generated for r in usable_rewards(g)]
        for group in candidates:
            reason = "prompt_too_long" if group is None else _reason(filters, group, step, ctx)
            if reason is None and len(outcome.groups) == want:
                reason = "surplus"
            if reason is not None:
                outcome.filtered[reason] += 1
                continue
            assert group is not None
            if group.weight < 1.0:
                outcome.downweighted += 1
            rename_group(group, f"{run_id}/{step}/{len(outcome.groups)}")
            outcome.groups.append(group)
            outcome.slots.append(_position_of(group))
        batch = want - len(outcome.groups)
    return outcome


async def refill_step(
    ctx: RolloutContext,
    data: RunData,
    run_id: str,
    step: int,
    slots: list[int],
    missing: list[int],
    fallback_version: int,
    have: Mapping[int, SampleGroup],
) -> list[SampleGroup]:
    """The groups of the `missing` slots of a step whose slots were recorded (`slots`: the prompt position of
    each), each of its recorded prompt: taken from `have` (groups by position) or generated anew, through no
    filter (the prompt passed them; choosing another would train one prompt twice in the epoch)."""

    async def fill(slot: int) -> SampleGroup:
        position = slots[slot]
        group = have.get(position)
        attempt = 0
        while group is None or _unusable(group):
            if group is not None:
                if attempt == REFILL_ATTEMPTS:
                    raise Unavailable(
                        f"step {step}: slot {slot}'s prompt could not be generated again in {attempt} attempts "
                        f"(first error: {group.samples[0].error})"
                    )
                logger.warning(
                    "run %s step %d: slot %d's prompt gave no usable sample (%s); generating it again",
                    run_id, step, slot, group.samples[0].error,
                )  # fmt: skip
            attempt += 1
            request = GroupRequest(
                run_id, f"{run_id}/{step}/p{position}", position, data.prompt_at(position), fallback_version
            )
            group = await ctx.rollout(ctx, request)
        rename_group(group, f"{run_id}/{step}/{slot}")
        return group

    return await gather_cancelling([fill(slot) for slot in missing])


def _unusable(group: SampleGroup) -> bool:
    return bool(group.samples) and all(s.status in UNUSABLE for s in group.samples)


def _position_of(group: SampleGroup) -> int:
    return int(group.prompt_id.removeprefix("train/"))


async def _candidate(
    ctx: RolloutContext, run_id: str, step: int, position: int, data: RunData, fallback_version: int
) -> SampleGroup | None:
    """The scored group of the prompt at `position`, or None when the prompt is too long (`prompt_too_long`)."""
    prompt = data.prompt_at(position)
    if prompt_too_long(ctx, len(ctx.encode(ctx.render(prompt.prompt)))):
        return None
    request = GroupRequest(run_id, f"{run_id}/{step}/p{position}", position, prompt, fallback_version)
    return await ctx.rollout(ctx, request)


def _reason(filters: FilterRegistry, group: SampleGroup, step: int, ctx: RolloutContext) -> str | None:
    ro = ctx.spec.rollout
    reason = filters.reason_to_drop(list(ro.filters), group)
    return reason or stale_rule(group, step, ro.max_staleness, ro.stale_groups, ro.stale_weight)
