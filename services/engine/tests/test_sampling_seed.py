"""`sampling_seed`: a seeded request draws the same tokens whatever else shares its batch, whatever the
engine's own generator has done, and whatever the load; another seed draws others."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from engine_test_support import RunningEngine, wait_until_running

from rlfleet_engine.sampler import sample, seeded_generator
from rlfleet_engine.sampling_params import SamplingParams

SEEDED = {"temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}


def _tokens(seed: int | None, neighbours: int, engine_seed: int, steps: int = 12) -> list[int]:
    """The tokens row 0 draws over `steps` decode steps, next to `neighbours` unseeded rows."""
    params = SamplingParams(temperature=1.0, sampling_seed=seed)
    own = seeded_generator(seed, 0)
    engine_generator = torch.Generator().manual_seed(engine_seed)
    out = []
    for step in range(steps):
        row = torch.randn(1, 64, generator=torch.Generator().manual_seed(step))  # the same logits every run
        logits = torch.cat([row, torch.randn(neighbours, 64, generator=engine_generator)])
        batch = [params] + [SamplingParams(temperature=1.0)] * neighbours
        out.append(sample(logits, batch, generator=engine_generator, row_generators=[own] + [None] * neighbours))
    return [drawn.token_ids[0] for drawn in out]


def test_a_seeded_request_samples_the_same_tokens_in_any_batch() -> None:
    alone = _tokens(seed=7, neighbours=0, engine_seed=0)
    assert _tokens(seed=7, neighbours=3, engine_seed=1) == alone
    assert _tokens(seed=8, neighbours=0, engine_seed=0) != alone


def test_an_unseeded_request_follows_the_engine_generator() -> None:
    assert _tokens(seed=None, neighbours=0, engine_seed=0) != _tokens(seed=None, neighbours=0, engine_seed=1)


def test_the_seed_is_an_sglang_sampling_parameter() -> None:
    params = SamplingParams.model_validate({"sampling_seed": 5, "temperature": 0.5})
    assert params.sampling_seed == 5 and "sampling_seed" not in (params.model_extra or {})
    assert seeded_generator(None, 0) is None


def test_each_sample_of_a_seed_has_its_own_stream() -> None:
    def draws(seed: int, sample_index: int) -> list[int]:
        generator = seeded_generator(seed, sample_index)
        return torch.randint(0, 1000, (8,), generator=generator).tolist()

    assert draws(5, 0) == draws(5, 0)
    assert len({tuple(draws(5, 0)), tuple(draws(5, 1)), tuple(draws(6, 0))}) == 3


@pytest.mark.e2e
def test_seeded_samples_do_not_depend_on_the_load(engine: RunningEngine) -> None:
    body = {"text": "ab", "sampling_params": {**SEEDED, "max_new_tokens": 8, "n": 2}}
    idle = [o["output_ids"] for o in engine.generate(body)]
    single = engine.generate({"text": "ab", "sampling_params": {**SEEDED, "max_new_tokens": 8}})["output_ids"]
    assert idle[0] == single and idle[1] != idle[0], "sample k draws from its own stream, sample 0 as n=1 does"

    # 7 of the engine's 8 rows busy: the two samples now run one after the other, not side by side.
    busy = threading.Thread(
        target=lambda: engine.generate(
            {"text": ["zz"] * 7, "sampling_params": {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 60}},
            timeout=60,
        )
    )
    busy.start()
    try:
        wait_until_running(engine, 7)
        loaded = [o["output_ids"] for o in engine.generate(body, timeout=60)]
    finally:
        busy.join(timeout=60)
    assert loaded == idle


@pytest.mark.e2e
def test_prompts_of_a_batch_sample_as_they_would_alone(engine: RunningEngine) -> None:
    def outputs(body: dict[str, Any]) -> list[list[int]]:
        out = engine.generate(body)
        return [o["output_ids"][:8] for o in (out if isinstance(out, list) else [out])]

    alone = outputs({"text": "ab", "sampling_params": {**SEEDED, "max_new_tokens": 8}})
    assert outputs({"text": ["ab", "ab"], "sampling_params": {**SEEDED, "max_new_tokens": 8}}) == alone * 2
    # Without max_new_tokens the budget is the default one; the tokens must not change with it.
    assert outputs({"text": ["ab", "ab"], "sampling_params": SEEDED}) == alone * 2
