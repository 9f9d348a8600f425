"""When a step's failures fail the run: a wave with no usable sample is a fleet that is down only when no wave
of the step has given one yet, or when as many prompts in a row as the step's first wave took gave none. A prompt
that cannot be scored is otherwise filtered and refilled, however small the refill wave. No processes; the rollout
function is a fake that fails the prompts it is told to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import json_format

from rlfleet.errors import Unavailable
from rlfleet.run_spec import resolve
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import LoadedDataset, Prompt
from rlfleet_rollout.group_filters import FilterRegistry, all_failed
from rlfleet_rollout.group_producer import GroupRequest
from rlfleet_rollout.run_data import RunData
from rlfleet_rollout.step_producer import REFILL_ATTEMPTS, StepOutcome, produce_step, refill_step

RUN = "run1"


class Rollout:
    """Every prompt gets a mixed group, except where `fails(position)`: each of its samples FAILED, as when the
    reward function errors on its label, or the fleet is down."""

    def __init__(self, fails: Callable[[int], bool]) -> None:
        self.fails = fails

    async def __call__(self, ctx: Any, request: GroupRequest) -> SampleGroup:
        failed = self.fails(request.position)
        status = SampleStatus.SAMPLE_STATUS_FAILED if failed else SampleStatus.SAMPLE_STATUS_OK
        error = "reward function failed" if failed else ""
        samples = [
            Sample(index=j, reward=0.0 if failed else float(j), status=status, weight_versions=[10**6], error=error)
            for j in range(2)
        ]
        return SampleGroup(group_id=request.group_id, prompt_id=f"train/{request.position}", samples=samples)


def _produce(rollout: Rollout, groups_per_step: int) -> StepOutcome:
    raw = {"rollout": {"group_size": 2, "groups_per_step": groups_per_step, "filters": ["all_failed"]}}
    spec = resolve(json_format.ParseDict(raw, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(100)], [], []), seed=1)
    ctx = type("Ctx", (), {"spec": spec, "rollout": rollout, "encode": staticmethod(list), "render": str,
                           "context_tokens": 0})()  # fmt: skip
    filters = FilterRegistry({"all_failed": all_failed})
    return asyncio.run(produce_step(ctx, data, filters, RUN, 0, 0, 0))


def test_a_prompt_that_fails_alone_in_a_refill_wave_is_refilled() -> None:
    """Prompt 1 fails in the first wave, prompt 2 alone in the refill wave: the run failed there, though the same
    prompt in a bigger wave was filtered and refilled."""
    outcome = _produce(Rollout(lambda p: p in (1, 2)), groups_per_step=2)
    assert outcome.slots == [0, 3] and outcome.filtered == {"all_failed": 2} and outcome.end == 4


def test_prompts_that_fail_alone_in_refill_waves_one_after_another_are_refilled() -> None:
    """Prompt 1 fails in the first wave, then prompts 4 and 5 each alone in a refill wave: a reward function that
    fails on a third of the prompts does that one time in nine, and the second such wave failed the run."""
    outcome = _produce(Rollout(lambda p: p in (1, 4, 5)), groups_per_step=4)
    assert outcome.slots == [0, 2, 3, 6] and outcome.filtered == {"all_failed": 3} and outcome.end == 7


def test_a_fleet_down_from_the_start_fails_the_step_at_its_first_wave() -> None:
    with pytest.raises(Unavailable, match=r"step 0: no sample of 4 prompts in a row could be generated and scored"):
        _produce(Rollout(lambda p: True), groups_per_step=4)


def test_a_fleet_that_goes_down_mid_step_fails_it_within_a_wave() -> None:
    """Prompts 0-2 pass, 3 and on fail (the fleet went down): the step must not consume the dataset wave after wave
    up to max_prompts_per_step; as many prompts in a row without a usable sample as the first wave took end it."""
    asked: list[int] = []

    def fails(position: int) -> bool:
        asked.append(position)
        return position >= 3

    with pytest.raises(Unavailable, match=r"step 0: no sample of 6 prompts in a row could be generated and scored"):
        _produce(Rollout(fails), groups_per_step=6)
    assert max(asked) == 6 + 3 + 3 - 1  # the first wave, then two refill waves of its three empty slots


def _refill(rollout: Rollout, slots: list[int], missing: list[int]) -> list[SampleGroup]:
    spec = resolve(json_format.ParseDict({"rollout": {"group_size": 2, "groups_per_step": len(slots)}}, RunSpec()))
    data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(100)], [], []), seed=1)
    ctx = type("Ctx", (), {"spec": spec, "rollout": rollout})()
    return asyncio.run(refill_step(ctx, data, RUN, 3, slots, missing, 0, {}))


def test_a_re_produced_slot_that_gave_no_usable_sample_is_generated_once_more() -> None:
    """The slot's prompt is fixed: one passing fault on it (an engine restarting) failed the whole run."""
    asked: list[int] = []

    def fails_once(position: int) -> bool:
        asked.append(position)
        return asked.count(position) == 1 and position == 7

    groups = _refill(Rollout(fails_once), slots=[5, 7, 9], missing=[1, 2])
    assert [g.group_id for g in groups] == [f"{RUN}/3/1", f"{RUN}/3/2"] and sorted(asked) == [7, 7, 9]
    assert all(s.status == SampleStatus.SAMPLE_STATUS_OK for g in groups for s in g.samples)


def test_a_re_produced_slot_that_keeps_failing_fails_the_step_naming_it() -> None:
    asked: list[int] = []

    def always(position: int) -> bool:
        asked.append(position)
        return True

    with pytest.raises(Unavailable, match=r"step 3: slot 0's prompt could not be generated again in 2 attempts"):
        _refill(Rollout(always), slots=[4], missing=[0])
    assert asked == [4] * REFILL_ATTEMPTS
