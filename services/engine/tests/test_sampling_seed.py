"""`sampling_seed`: a seeded request draws the same tokens whatever else shares its batch and whatever the
engine's own generator has done; another seed draws others."""

from __future__ import annotations

import torch

from rlfleet_engine.sampler import sample
from rlfleet_engine.sampling_params import SamplingParams


def _tokens(seed: int | None, neighbours: int, engine_seed: int, steps: int = 12) -> list[int]:
    """The tokens row 0 draws over `steps` decode steps, next to `neighbours` unseeded rows."""
    params = SamplingParams(temperature=1.0, sampling_seed=seed)
    engine_generator = torch.Generator().manual_seed(engine_seed)
    out = []
    for step in range(steps):
        row = torch.randn(1, 64, generator=torch.Generator().manual_seed(step))  # the same logits every run
        logits = torch.cat([row, torch.randn(neighbours, 64, generator=engine_generator)])
        batch = [params] + [SamplingParams(temperature=1.0)] * neighbours
        out.append(sample(logits, batch, generator=engine_generator).token_ids[0])
    return out


def test_a_seeded_request_samples_the_same_tokens_in_any_batch() -> None:
    alone = _tokens(seed=7, neighbours=0, engine_seed=0)
    assert _tokens(seed=7, neighbours=3, engine_seed=1) == alone
    assert _tokens(seed=8, neighbours=0, engine_seed=0) != alone


def test_an_unseeded_request_follows_the_engine_generator() -> None:
    assert _tokens(seed=None, neighbours=0, engine_seed=0) != _tokens(seed=None, neighbours=0, engine_seed=1)


def test_the_seed_is_an_sglang_sampling_parameter() -> None:
    params = SamplingParams.model_validate({"sampling_seed": 5, "temperature": 0.5})
    assert params.sampling_seed == 5 and "sampling_seed" not in (params.model_extra or {})
    generator = params.seeded_generator()
    assert generator is not None and params.seeded_generator() is generator  # one generator per request
    assert SamplingParams().seeded_generator() is None
