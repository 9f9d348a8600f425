"""A step re-produced after the orchestrator died while appending it keeps the prompts its first producer
chose: the slots the stream lacks are filled with the recorded prompts, not with whatever a new pass through
the filters picks (newer weights solve other prompts), which trained one prompt twice in the epoch and left
others out. And each group a step appends is counted once, an append whose reply was lost included. Real Redis;
the rollout function is a fake whose solved prompts change between attempts."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis
from google.protobuf import json_format

from rlfleet.run_spec import resolve
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import Run, RunSpec
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import LoadedDataset, Prompt
from rlfleet_rollout.group_filters import FilterRegistry, zero_variance
from rlfleet_rollout.group_producer import GroupRequest
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_data import DataPosition, RunData
from rlfleet_rollout.run_loop import RunDeps, _produce_step

RUN = "run1"
GROUPS_PER_STEP = 4


@dataclass
class Policy:
    """Solves every other prompt; which ones flips with `attempt` (a restart on newer weights)."""

    attempt: int = 0
    generated: list[int] = field(default_factory=list)

    async def __call__(self, ctx: Any, request: GroupRequest) -> SampleGroup:
        self.generated.append(request.position)
        solved = (request.position + self.attempt) % 2 == 0
        samples = [
            Sample(
                sample_id=f"{request.group_id}/{j}",
                index=j,
                prompt_token_ids=[1, 2],
                response_token_ids=[3],
                rollout_logprobs=[-0.5],
                loss_mask=[1],
                reward=float(j) if solved else 0.0,  # unsolved: zero variance, filtered
                weight_versions=[10**6],  # never stale
                status=SampleStatus.SAMPLE_STATUS_OK,
            )
            for j in range(2)
        ]
        return SampleGroup(
            group_id=request.group_id, run_id=RUN, prompt_id=f"train/{request.position}", samples=samples, weight=1.0
        )


class Core:
    def __init__(self) -> None:
        self.run = Run(id=RUN)

    async def get(self, run_id: str) -> Run:
        return self.run

    async def update(self, run_id: str, change: Any) -> Run:
        change(self.run)
        return self.run


class DiesWhileAppending(SampleStream):
    def __init__(self, *args: Any, appends: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.left = appends

    def append(self, group: SampleGroup) -> str | None:
        if self.left == 0:
            raise KeyboardInterrupt("the orchestrator died")
        self.left -= 1
        return super().append(group)


def test_a_step_reproduced_after_a_crash_keeps_its_prompts(redis_client: redis.Redis, redis_prefix: str) -> None:
    raw = {
        "rollout": {"group_size": 2, "groups_per_step": GROUPS_PER_STEP, "oversample": 2, "filters": ["zero_variance"]}
    }
    spec = resolve(json_format.ParseDict(raw, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(100)], [], []), seed=1)
    policy = Policy()
    ctx = type("Ctx", (), {"spec": spec, "rollout": policy, "encode": staticmethod(list), "render": str,
                           "context_tokens": 0})()  # fmt: skip
    filters = FilterRegistry({"zero_variance": zero_variance})
    deps = RunDeps(Core(), None, None, None, redis_client, None, RolloutMetrics(), filters, None)  # type: ignore[arg-type]
    stream = SampleStream(redis_client, RUN, prefix=redis_prefix)

    def produce(step: int, on: SampleStream, position: DataPosition) -> None:
        asyncio.run(_produce_step(ctx, deps, data, on, position, RUN, step, 0))  # type: ignore[arg-type]

    first = DataPosition(redis_client, RUN, prefix=redis_prefix)
    produce(0, stream, first)
    dying = DiesWhileAppending(redis_client, RUN, prefix=redis_prefix, appends=2)
    try:
        produce(1, dying, first)
    except KeyboardInterrupt:
        pass
    chosen = first.slots_of(1)
    assert chosen is not None and len(chosen) == GROUPS_PER_STEP and stream.length() == GROUPS_PER_STEP + 2

    policy.attempt, policy.generated = 1, []  # the restarted orchestrator, on newer weights
    restarted = DataPosition(redis_client, RUN, prefix=redis_prefix)
    produce(1, stream, restarted)
    assert sorted(policy.generated) == sorted(chosen[2:])  # only the missing slots, with their prompts
    produce(2, stream, restarted)

    entries = {e.group.group_id: int(e.group.prompt_id.removeprefix("train/")) for e in stream.entries()}
    assert [entries[f"{RUN}/1/{i}"] for i in range(GROUPS_PER_STEP)] == chosen
    trained = Counter(entries.values())
    assert all(count == 1 for count in trained.values()), trained  # no prompt twice in the epoch
    assert len(entries) == 3 * GROUPS_PER_STEP


def test_a_steps_mean_reward_leaves_out_samples_that_failed(redis_client: redis.Redis, redis_prefix: str) -> None:
    """A failed sample carries reward 0 for want of a score: counted, an engine fault read as a worse policy."""
    spec = resolve(json_format.ParseDict({"rollout": {"group_size": 2, "groups_per_step": 2}}, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(10)], [], []), seed=1)
    policy = Policy()

    async def half_failed(ctx: Any, request: GroupRequest) -> SampleGroup:
        group = await policy(ctx, request)
        group.samples[0].status, group.samples[0].reward = SampleStatus.SAMPLE_STATUS_FAILED, 0.0
        group.samples[1].reward = 1.0
        return group

    ctx = type("Ctx", (), {"spec": spec, "rollout": staticmethod(half_failed), "encode": staticmethod(list),
                           "render": str, "context_tokens": 0})()  # fmt: skip
    core, metrics = Core(), RolloutMetrics()
    deps = RunDeps(core, None, None, None, redis_client, None, metrics, FilterRegistry({}), None)  # type: ignore[arg-type]
    stream = SampleStream(redis_client, RUN, prefix=redis_prefix)
    position = DataPosition(redis_client, RUN, prefix=redis_prefix)
    asyncio.run(_produce_step(ctx, deps, data, stream, position, RUN, 0, 0))  # type: ignore[arg-type]
    assert core.run.progress.mean_reward == 1.0 and metrics.reward_mean._value.get() == 1.0


def test_a_steps_mean_reward_counts_the_groups_its_filters_dropped(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """zero_variance keeps only mixed groups: over the trained groups alone the mean stayed near the middle
    however the policy did."""
    raw = {"rollout": {"group_size": 2, "groups_per_step": 2, "oversample": 2, "filters": ["zero_variance"]}}
    spec = resolve(json_format.ParseDict(raw, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(10)], [], []), seed=1)
    ctx = type("Ctx", (), {"spec": spec, "rollout": Policy(), "encode": staticmethod(list), "render": str,
                           "context_tokens": 0})()  # fmt: skip
    core, metrics = Core(), RolloutMetrics()
    filters = FilterRegistry({"zero_variance": zero_variance})
    deps = RunDeps(core, None, None, None, redis_client, None, metrics, filters, None)  # type: ignore[arg-type]
    stream = SampleStream(redis_client, RUN, prefix=redis_prefix)
    position = DataPosition(redis_client, RUN, prefix=redis_prefix)
    asyncio.run(_produce_step(ctx, deps, data, stream, position, RUN, 0, 0))  # type: ignore[arg-type]
    # Four prompts, two solved ([0, 1]) and trained, two unsolved ([0, 0]) and filtered.
    assert core.run.progress.groups_filtered == 2
    assert core.run.progress.mean_reward == 0.25 and metrics.reward_mean._value.get() == 0.25


def test_a_group_whose_append_was_retried_after_a_lost_reply_is_counted_once(
    redis_client: redis.Redis, redis_prefix: str, redis_losing_first_script_reply: redis.Redis
) -> None:
    """The first append's reply was lost after Redis ran it; its retry was answered "appended before", and
    rlfleet_rollout_groups_produced missed the group (the stream had it). Producing the step again adds nothing."""
    spec = resolve(json_format.ParseDict({"rollout": {"group_size": 2, "groups_per_step": GROUPS_PER_STEP}}, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(20)], [], []), seed=1)
    ctx = type("Ctx", (), {"spec": spec, "rollout": Policy(), "encode": staticmethod(list), "render": str,
                           "context_tokens": 0})()  # fmt: skip
    metrics = RolloutMetrics()
    deps = RunDeps(Core(), None, None, None, redis_client, None, metrics, FilterRegistry({}), None)  # type: ignore[arg-type]
    position = DataPosition(redis_client, RUN, prefix=redis_prefix)
    stream = SampleStream(redis_losing_first_script_reply, RUN, prefix=redis_prefix)
    asyncio.run(_produce_step(ctx, deps, data, stream, position, RUN, 0, 0))  # type: ignore[arg-type]
    again = SampleStream(redis_client, RUN, prefix=redis_prefix)
    asyncio.run(_produce_step(ctx, deps, data, again, position, RUN, 0, 0))  # type: ignore[arg-type]

    def counted(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    assert again.length() == GROUPS_PER_STEP
    assert counted("rlfleet_rollout_groups_produced_total") == GROUPS_PER_STEP
    assert counted("rlfleet_rollout_group_staleness_count") == GROUPS_PER_STEP


def test_a_step_reproduced_after_a_crash_keeps_the_mean_reward_its_producer_recorded(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """The restarted orchestrator refills 2 of the 4 groups: its mean reward covered those 2 alone, on newer
    weights, and replaced the step's own in the run's progress."""
    spec = resolve(json_format.ParseDict({"rollout": {"group_size": 2, "groups_per_step": GROUPS_PER_STEP}}, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(20)], [], []), seed=1)
    policy = Policy()
    ctx = type("Ctx", (), {"spec": spec, "rollout": policy, "encode": staticmethod(list), "render": str,
                           "context_tokens": 0})()  # fmt: skip
    core = Core()
    deps = RunDeps(core, None, None, None, redis_client, None, RolloutMetrics(), FilterRegistry({}), None)  # type: ignore[arg-type]
    position = DataPosition(redis_client, RUN, prefix=redis_prefix)
    dying = DiesWhileAppending(redis_client, RUN, prefix=redis_prefix, appends=2)
    try:
        asyncio.run(_produce_step(ctx, deps, data, dying, position, RUN, 0, 0))  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pass
    slots = position.slots_of(0)
    assert slots is not None
    # Every other prompt solved (rewards 0 and 1), the others not (0 and 0): the step's own mean.
    expected = sum(0.5 if position_ % 2 == 0 else 0.0 for position_ in slots) / len(slots)

    async def solves_all(ctx: Any, request: GroupRequest) -> SampleGroup:  # newer weights
        group = await policy(ctx, request)
        for sample in group.samples:
            sample.reward = 1.0
        return group

    later = type("Ctx", (), {"spec": spec, "rollout": staticmethod(solves_all), "encode": staticmethod(list),
                             "render": str, "context_tokens": 0})()  # fmt: skip
    stream = SampleStream(redis_client, RUN, prefix=redis_prefix)
    restarted = DataPosition(redis_client, RUN, prefix=redis_prefix)
    asyncio.run(_produce_step(later, deps, data, stream, restarted, RUN, 0, 0))  # type: ignore[arg-type]
    assert core.run.progress.mean_reward == expected
