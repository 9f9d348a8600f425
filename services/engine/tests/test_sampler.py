"""Sampling without HTTP: greedy, temperature, top-k, top-p, min-p, per-row parameters, and the logprob convention."""

from __future__ import annotations

import pytest
import torch

from rlfleet_engine.sampler import sample, truncated_probs
from rlfleet_engine.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # probabilities at temperature 1


def draws(params: SamplingParams, count: int = 400, logits: torch.Tensor = LOGITS) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    batch = logits.expand(count, -1)
    return sample(batch, [params] * count, generator=generator).token_ids


def test_greedy_takes_argmax_and_reports_log_softmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2)
    assert out.token_ids == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([float(expected[0, 1]), float(expected[1, 0])], abs=1e-6)


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    assert set(draws(SamplingParams(temperature=1.5, top_k=1))) == {0}


def test_sampled_logprob_is_temperature_scaled_and_not_renormalised() -> None:
    params = SamplingParams(temperature=0.7, top_k=2)
    out = sample(LOGITS.expand(50, -1), [params] * 50, generator=torch.Generator().manual_seed(1))
    full = torch.log_softmax(LOGITS[0] / 0.7, dim=-1)
    for token, logprob in zip(out.token_ids, out.logprobs, strict=True):
        assert logprob == pytest.approx(float(full[token]), abs=1e-6)


def test_top_k_limits_the_candidates() -> None:
    assert set(draws(SamplingParams(top_k=2))) == {0, 1}


def test_a_top_k_past_the_vocabulary_keeps_every_token() -> None:
    # SGLang reads it as no top-k; no value a request carries may overflow the sampler's tensors.
    assert set(draws(SamplingParams(top_k=2**63))) == {0, 1, 2, 3}


def test_a_temperature_past_float32_draws_uniformly_among_the_possible_tokens() -> None:
    # Finite, yet inf in float32 (an infinite one is refused, as SGLang refuses it).
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]])  # a masked token stays impossible, not NaN
    assert set(draws(SamplingParams(temperature=1e300), logits=logits)) == {0, 1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Mass before token 1 is 0.5 <= 0.7 (kept); before token 2 it is 0.8 > 0.7 (dropped).
    assert set(draws(SamplingParams(top_p=0.7))) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # 0.5 * 0.4 = 0.2: tokens 2 (0.15) and 3 (0.05) fall below.
    assert set(draws(SamplingParams(min_p=0.4))) == {0, 1}


def test_temperature_sampling_follows_the_scaled_distribution() -> None:
    tokens = draws(SamplingParams(temperature=2.0), count=4000)
    expected = torch.softmax(LOGITS[0] / 2.0, dim=-1)
    observed = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert torch.allclose(observed, expected, atol=0.03), (observed, expected)


def test_each_row_uses_its_own_parameters() -> None:
    logits = torch.cat([LOGITS, LOGITS, torch.tensor([[0.0, 0.0, 9.0, 0.0]])])
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=2), SamplingParams(temperature=0.5)]
    generator = torch.Generator().manual_seed(3)
    seen = [sample(logits, params, generator=generator).token_ids for _ in range(100)]
    assert {row[0] for row in seen} == {0}
    assert {row[1] for row in seen} <= {0, 1}
    assert {row[2] for row in seen} == {2}


def test_top_logprobs_come_from_the_same_distribution() -> None:
    out = sample(LOGITS, [SamplingParams(temperature=0.0)], top_logprobs_nums=[2])
    expected = torch.log_softmax(LOGITS[0], dim=-1)
    assert [tok for _, tok in out.top_logprobs[0]] == [0, 1]
    assert out.top_logprobs[0][1][0] == pytest.approx(float(expected[1]), abs=1e-6)


def test_truncation_always_keeps_the_most_likely_token() -> None:
    probs = torch.tensor([[0.9, 0.05, 0.05]])
    kept = truncated_probs(probs, [SamplingParams(top_p=0.01, min_p=1.0)], vocab=3)
    assert kept.tolist() == [[pytest.approx(0.9), 0.0, 0.0]]


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"top_k": -2},
        {"max_new_tokens": -1},
        {"n": 0},
        {"min_p": 2.0},
        {"repetition_penalty": 1.3},
        {"stop": [""]},
        {"sampling_seed": 2**64},
    ],
)
def test_out_of_range_parameters_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**fields)


def test_unknown_parameters_are_ignored_and_stop_may_be_a_string() -> None:
    params = SamplingParams(stop="\n", some_future_knob=3, repetition_penalty=1.0)
    assert params.stop == ["\n"]
