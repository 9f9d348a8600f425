"""The router's estimate of the engines' characters per token, learned from the prompt tokens they report."""

from __future__ import annotations

import pytest

from rlfleet_router.chars_per_token import DEFAULT_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN, CharsPerToken
from rlfleet_router.policies import RoutingRequest


def test_starts_at_the_default_and_follows_the_engines_answers() -> None:
    estimate = CharsPerToken()
    assert estimate.value == DEFAULT_CHARS_PER_TOKEN
    estimate.observe(chars=900, tokens=900)  # a character-level tokenizer
    assert 1 < estimate.value < 3, "one answer moves it, but a few prompts' worth of the default still counts"
    for _ in range(30):
        estimate.observe(chars=900, tokens=900)
    assert estimate.value < 1.1, "within a few dozen answers"
    for _ in range(300):  # the engines change tokenizer: the estimate follows the recent answers
        estimate.observe(chars=600, tokens=200)
    assert estimate.value == pytest.approx(3.0, abs=0.15)


def test_ignores_empty_reports_and_stays_within_bounds() -> None:
    estimate = CharsPerToken()
    estimate.observe(chars=100, tokens=0)
    estimate.observe(chars=0, tokens=100)
    assert estimate.value == DEFAULT_CHARS_PER_TOKEN
    for _ in range(1000):
        estimate.observe(chars=10**6, tokens=1)
    assert estimate.value == MAX_CHARS_PER_TOKEN


def test_a_text_prompt_is_sized_by_the_estimate_and_only_single_prompts_teach_it() -> None:
    text = {"text": "x" * 100, "sampling_params": {"max_new_tokens": 10}}
    assert RoutingRequest("/generate", text).tokens == 25 + 10
    assert RoutingRequest("/generate", text, chars_per_token=1.0).tokens == 100 + 10
    assert RoutingRequest("/generate", text).single_text_chars == 100
    assert RoutingRequest("/v1/completions", {"text": "x" * 100}).single_text_chars == 100
    # Reported prompt tokens are summed over samples and prompts, or the prompt is not text: nothing to learn.
    samples = {"text": "x" * 100, "sampling_params": {"n": 4}}
    batch = {"text": ["x" * 100, "y" * 50]}
    ids = {"input_ids": [1, 2, 3]}
    assert all(RoutingRequest("/generate", body).single_text_chars is None for body in (samples, batch, ids))
    # A chat's messages reach the engine inside a template the router does not see.
    assert RoutingRequest("/v1/chat/completions", {"text": "x" * 100}).single_text_chars is None
