"""The generated arithmetic pool is large enough for the epoch guard to cover a step's whole span, and a run
started on a smaller pool (sized before refills were counted) resumes on the pool it started on."""

from __future__ import annotations

import asyncio
import math

import redis
from google.protobuf import json_format

from rlfleet.run_spec import resolve, validate
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet_rollout.datasets import load_dataset
from rlfleet_rollout.run_data import DataPosition, RunData
from rlfleet_rollout.run_loop import _check_same_dataset


def _short_refilling_run() -> RunSpec:
    """3 steps of 16 groups under zero_variance: 48 prompts sent first, up to 64 (max_prompts_per_step) a step."""
    raw = {
        "model": {"path": "/x"},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "seed": 7},
        "rollout": {"group_size": 8, "groups_per_step": 16, "filters": ["zero_variance"]},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "schedule": {"steps": 3},
    }
    spec = resolve(json_format.ParseDict(raw, RunSpec()))
    validate(spec)
    return spec


def test_no_step_of_a_short_refilling_run_takes_a_problem_twice() -> None:
    """The pool held 48 problems of the 9001 the split has, and the guard clamped to a third of them (16): a step
    refilling past 16 prompts took one problem twice."""
    spec = _short_refilling_run()
    span = spec.rollout.max_prompts_per_step
    data = RunData.from_spec(spec)
    assert len(data.train) == 3 * span and data.window == span
    names = [data.prompt_at(p).prompt for p in range(4 * len(data.train))]
    assert all(len(set(names[s : s + span])) == span for s in range(len(names) - span + 1))


def test_a_run_started_on_a_smaller_pool_resumes_on_it(redis_client: redis.Redis, redis_prefix: str) -> None:
    spec = _short_refilling_run()
    ro = spec.rollout
    first_waves = spec.schedule.steps * math.ceil(ro.oversample * ro.groups_per_step)
    started = RunData(load_dataset(spec.dataset, first_waves), seed=spec.dataset.seed, window=ro.max_prompts_per_step)
    before = DataPosition(redis_client, "old-run", prefix=redis_prefix)
    before.pin_dataset(started.fingerprint())  # as the run's first start recorded it

    resumed = RunData.from_spec(spec, DataPosition(redis_client, "old-run", prefix=redis_prefix))
    assert [p.prompt for p in resumed.train] == [p.prompt for p in started.train]
    asyncio.run(_check_same_dataset(resumed, DataPosition(redis_client, "old-run", prefix=redis_prefix)))

    fresh = RunData.from_spec(spec, DataPosition(redis_client, "new-run", prefix=redis_prefix))
    assert len(fresh.train) == 3 * ro.max_prompts_per_step
    asyncio.run(_check_same_dataset(fresh, DataPosition(redis_client, "new-run", prefix=redis_prefix)))
    again = RunData.from_spec(spec, DataPosition(redis_client, "new-run", prefix=redis_prefix))
    assert again.fingerprint() == fresh.fingerprint()
