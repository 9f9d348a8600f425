"""Generations stay within the model's context (read from its config.json): max_new_tokens is cut to the
room a prompt leaves, and a prompt that fills the context is skipped as too long (a training prompt's group
filtered, a held-out prompt left out of the evaluation and counted), instead of an engine's refusal failing
samples, whole eval requests, or the run."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_partial_rollout import MAX_NEW_TOKENS, _context

from rlfleet.errors import InvalidInput
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.evaluation import evaluate
from rlfleet_rollout.model_directory import context_length
from rlfleet_rollout.router_client import Completion, RouterClient
from rlfleet_rollout.run_data import RunData
from rlfleet_rollout.run_loop import _context_tokens
from rlfleet_rollout.step_producer import _candidate


def test_max_new_tokens_is_cut_to_the_room_the_context_leaves(tokenizer_dir: Path) -> None:
    """An engine refuses prompt + max_new_tokens reaching its context (SGLang: 400), which failed every sample of
    a long prompt; single_turn and each multi_turn turn send what fits. The cut left prompt + max_new_tokens equal
    to the context, which SGLang refuses too (rlfleet-engine took it)."""
    ctx = _context(tokenizer_dir, router=None, on_weight_update="finish")
    assert ctx.within_context({"max_new_tokens": MAX_NEW_TOKENS}, 100) == {"max_new_tokens": MAX_NEW_TOKENS}
    bounded = replace(ctx, context_tokens=128)
    assert bounded.within_context({"max_new_tokens": MAX_NEW_TOKENS, "top_p": 1.0}, 100) == {
        "max_new_tokens": 27,
        "top_p": 1.0,
    }
    assert bounded.within_context({"max_new_tokens": MAX_NEW_TOKENS}, 10) == {"max_new_tokens": MAX_NEW_TOKENS}
    for prompt_tokens in (127, 128):
        with pytest.raises(InvalidInput, match="128"):
            bounded.within_context({"max_new_tokens": MAX_NEW_TOKENS}, prompt_tokens)


def test_the_context_length_is_read_from_the_models_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_positions": 1024}')
    assert context_length(str(tmp_path)) == 1024
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768, "n_positions": 1024}')
    assert context_length(str(tmp_path)) == 32768
    assert context_length(str(tmp_path / "missing")) == 0


class RefusesPastTheContext:
    """Answers each prompt with its own text reversed, but refuses a whole request (as SGLang does with a 400)
    when any prompt and its max_new_tokens reach a context of 16 tokens."""

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if any(len(ids) + p["max_new_tokens"] >= 16 for ids, p in zip(prompts, params, strict=True)):
            raise InvalidInput("HTTP 400: Requested token count exceeds the model's maximum context length")
        return [Completion((1,), (-0.1,), "3", FinishReason.FINISH_REASON_STOP, 0) for _ in prompts]


def test_a_held_out_prompt_past_the_context_is_left_out_alone(tokenizer_dir: Path) -> None:
    """Sent with the others, its refusal failed every prompt of the request: 63 answerable prompts scored 0. Then it
    counted as a wrong, failed sample, where training skips such a prompt as too long: it is left out as there,
    counted in prompts_too_long, and the others are evaluated."""
    ctx = replace(_context(tokenizer_dir, RefusesPastTheContext(), "finish"), context_tokens=16)
    prompts = [Prompt(prompt="1+2=", answer="3")] * 3 + [Prompt(prompt="1+2=" * 5, answer="3")]
    result = asyncio.run(evaluate(ctx, "run-1", 0, prompts, batch_size=32, trainer_version=0))
    assert result.accuracy == 1.0 and (result.size, result.prompts_too_long, result.failed) == (3, 1, 0)
    with pytest.raises(InvalidInput, match="every one of the 1 held-out prompts .* context of 16 tokens"):
        asyncio.run(evaluate(ctx, "run-1", 0, prompts[3:], batch_size=32, trainer_version=0))


def test_a_prompt_the_context_cannot_hold_is_filtered_as_too_long(tokenizer_dir: Path) -> None:
    """Generated, all its samples failed, and alone in a refill wave it failed the run (at every restart)."""
    base = _context(tokenizer_dir, RefusesPastTheContext(), "finish")
    data = RunData.from_spec(base.spec)
    tokens = len(base.encode(data.prompt_at(0).prompt))
    # One token short of the context leaves no max_new_tokens the engine takes (it refuses reaching the context).
    assert asyncio.run(_candidate(replace(base, context_tokens=tokens + 1), "run-1", 0, 0, data, 0)) is None
    assert asyncio.run(_candidate(replace(base, context_tokens=tokens + 2), "run-1", 0, 0, data, 0)) is not None


def _router(answer: Any, status: int = 200) -> RouterClient:
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(status, json=answer)

    return RouterClient(httpx.AsyncClient(transport=httpx.MockTransport(handle)), "http://router", timeout_s=5)


def test_the_context_is_the_engines_when_they_serve_less_than_the_model(tmp_path: Path) -> None:
    """An engine started with a shorter context (SGLang's --context-length) refused every prompt whose
    max_new_tokens, fitted to the model's config.json, reached its own: every long sample failed."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768}')
    model = str(tmp_path)

    def context(router: RouterClient) -> int:
        return asyncio.run(_context_tokens(router, model, "run-1"))

    assert context(_router({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})) == 4096
    assert context(_router({"data": [{"id": "m", "max_model_len": 65536}]})) == 32768  # the smaller of the two
    assert context(_router({"data": [{"id": "m"}]})) == 32768  # an answer that does not say
    assert context(_router({"error": "no such route"}, status=404)) == 32768  # a router that does not answer it
    (tmp_path / "config.json").write_text("{}")
    assert context(_router({"data": [{"id": "m", "max_model_len": 4096}]})) == 4096
