"""Logprob truth: what the engine reports equals a plain Hugging Face forward pass over prompt + output.

Holds for a single prompt, for a batch of prompts of different lengths (left padding must not
leak), for requests that join a batch already decoding (continuous batching), and for sampled
tokens (log_softmax(logits / T), the documented convention).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from engine_test_support import RunningEngine, reference_logprobs

pytestmark = pytest.mark.e2e
TOLERANCE = 1e-4


def check_against_reference(
    reference_model: Any, prompt: list[int], out: dict[str, Any], temperature: float = 1.0
) -> None:
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(t[2] is None for t in triples)
    expected = reference_logprobs(reference_model, prompt, out["output_ids"], temperature)
    got = [t[0] for t in triples]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < TOLERANCE, (got, expected)


def test_greedy_logprobs_match_a_forward_pass(engine: RunningEngine, reference_model: Any) -> None:
    prompt = [20, 21, 22, 23, 24, 25]
    out = engine.generate(
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        }
    )
    assert out["meta_info"]["completion_tokens"] == 12
    assert out["meta_info"]["prompt_tokens"] == len(prompt)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    check_against_reference(reference_model, prompt, out)


def test_padding_in_a_batch_does_not_change_logprobs(engine: RunningEngine, reference_model: Any) -> None:
    prompts = [[30, 31], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [60, 61, 62, 63, 64]]
    outs = engine.generate(
        {
            "input_ids": prompts,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
        }
    )
    assert len(outs) == 3
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_reference(reference_model, prompt, out)


def test_requests_joining_a_running_batch_keep_exact_logprobs(engine: RunningEngine, reference_model: Any) -> None:
    prompts = [[10 + i] * (3 + 2 * i) for i in range(5)]
    lengths = [40, 8, 25, 3, 15]

    def one(i: int) -> dict[str, Any]:
        return engine.generate(
            {
                "input_ids": prompts[i],
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": lengths[i], "ignore_eos": True},
            }
        )

    with ThreadPoolExecutor(max_workers=5) as pool:
        outs = list(pool.map(one, range(5)))
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_reference(reference_model, prompt, out)


def test_sampled_logprobs_are_log_softmax_of_scaled_logits(engine: RunningEngine, reference_model: Any) -> None:
    prompt = [33, 34, 35]
    out = engine.generate(
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_new_tokens": 10, "ignore_eos": True},
        }
    )
    check_against_reference(reference_model, prompt, out, temperature=0.7)


def test_text_prompt_and_top_logprobs(engine: RunningEngine, reference_model: Any) -> None:
    out = engine.generate(
        {
            "text": "12+34=",
            "return_logprob": True,
            "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        }
    )
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 4 and all(len(row) == 3 for row in tops)
    # SGLang's default logprob_start_len: the prompt's last token alone, its logprob null.
    [(logprob, token, text)] = out["meta_info"]["input_token_logprobs"]
    assert logprob is None and isinstance(token, int) and text == "="
    assert out["meta_info"]["input_top_logprobs"] == [None]
    # Greedy: the chosen token is the most likely one, with the same logprob.
    for chosen, row in zip(out["meta_info"]["output_token_logprobs"], tops, strict=True):
        assert row[0][1] == chosen[1] and abs(row[0][0] - chosen[0]) < 1e-6
        assert isinstance(chosen[2], str)
