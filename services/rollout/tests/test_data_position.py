"""Where each step of a run starts, in the real Redis: recorded once, known as its own by its writer, with
its slots' prompts, on the dataset the run started on."""

from __future__ import annotations

import asyncio

import pytest
import redis

from rlfleet.errors import InvalidInput
from rlfleet_rollout.datasets import LoadedDataset, Prompt
from rlfleet_rollout.run_data import DataPosition, RunData, StepCounts
from rlfleet_rollout.run_loop import _check_same_dataset


def test_each_step_starts_where_the_previous_one_ended(redis_client: redis.Redis, redis_prefix: str) -> None:
    position = DataPosition(redis_client, "run1", prefix=redis_prefix)
    assert position.start_of(0) == 0
    assert position.record_end(0, 12, [0, 3], StepCounts())
    assert position.start_of(1) == 12


def test_a_retried_record_is_still_its_producers_and_a_re_produced_step_is_not(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    first = DataPosition(redis_client, "run1", prefix=redis_prefix)
    assert first.record_end(3, 40, [30, 31], StepCounts())
    # The same write sent again (the client retried after its reply was lost): still the first record.
    assert first.record_end(3, 40, [30, 31], StepCounts())
    # An orchestrator restarted after the write re-produces the step: its record is not the first.
    restarted = DataPosition(redis_client, "run1", prefix=redis_prefix)
    assert not restarted.record_end(3, 40, [30, 32], StepCounts())
    assert restarted.start_of(4) == 40


def test_positions_recorded_before_producer_tokens_still_read(redis_client: redis.Redis, redis_prefix: str) -> None:
    position = DataPosition(redis_client, "run1", prefix=redis_prefix)
    redis_client.hset(position.key, "5", 77)
    assert position.start_of(5) == 77


def test_a_steps_slots_are_the_first_producers(redis_client: redis.Redis, redis_prefix: str) -> None:
    """A re-produced step fills its missing slots with the prompts its first producer chose."""
    first = DataPosition(redis_client, "run1", prefix=redis_prefix)
    assert first.slots_of(2) is None
    assert first.record_end(2, 30, [20, 22, 27], StepCounts())
    restarted = DataPosition(redis_client, "run1", prefix=redis_prefix)
    assert not restarted.record_end(2, 31, [20, 21, 30], StepCounts())
    assert restarted.slots_of(2) == [20, 22, 27] and restarted.start_of(3) == 30
    redis_client.hset(first.key, "9", "50 oldtoken")  # written before slots were recorded
    assert first.slots_of(8) is None and first.start_of(9) == 50


def test_a_run_resumed_on_changed_rows_is_refused(redis_client: redis.Redis, redis_prefix: str) -> None:
    """One row appended to the file while the run was stopped moved most held-out rows and renamed every
    saved position's prompt: the run would train some held-out prompts and repeat others."""
    rows = [Prompt(f"{i}+1=", str(i + 1)) for i in range(10)]
    data, same = (
        RunData(LoadedDataset(rows[:8], rows[8:], []), seed=1),
        RunData(LoadedDataset(rows[:8], rows[8:], []), seed=1),
    )
    grown = RunData(LoadedDataset([*rows[:8], Prompt("x", "y")], rows[8:], []), seed=1)
    assert data.fingerprint() == same.fingerprint() != grown.fingerprint()
    position = DataPosition(redis_client, "run1", prefix=redis_prefix)
    asyncio.run(_check_same_dataset(data, position))
    asyncio.run(_check_same_dataset(same, DataPosition(redis_client, "run1", prefix=redis_prefix)))
    with pytest.raises(InvalidInput, match="the rows differ from those the run started on"):
        asyncio.run(_check_same_dataset(grown, DataPosition(redis_client, "run1", prefix=redis_prefix)))
