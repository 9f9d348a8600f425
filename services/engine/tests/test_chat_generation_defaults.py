"""A chat request's unset sampling values come from the model's generation_config.json, as in SGLang (its default
`--sampling-defaults model`); a completion's do not; a file that is not JSON, or holds a value out of range, stops
the engine at start naming it. On a live engine of the tiny model, compared with /generate asked for the same
values under the same seed (same tokens, same logprobs: log_softmax(logits / T) shows the temperature used)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_test_support import RunningEngine, start_engine

from rlfleet.processes import ServiceStartError

pytestmark = pytest.mark.e2e

MODEL_DEFAULTS = {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
CHAT = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4, "seed": 7, "logprobs": True}


def model_with_generation_config(tiny_model_dir: Path, destination: Path, text: str) -> Path:
    shutil.copytree(tiny_model_dir, destination)
    (destination / "generation_config.json").write_text(text)
    return destination


@pytest.fixture(scope="module")
def recommending_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    """An engine of a model whose generation_config.json recommends MODEL_DEFAULTS (beside its eos and pad ids)."""
    own = json.loads((tiny_model_dir / "generation_config.json").read_text())
    root = tmp_path_factory.mktemp("recommending")
    model = model_with_generation_config(tiny_model_dir, root / "model", json.dumps({**own, **MODEL_DEFAULTS}))
    running = start_engine(model, root)
    yield running
    running.process.stop()


def generated(engine: RunningEngine, prompt_ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float]]:
    """What /generate samples for `prompt_ids` under `params`, with the chat request's budget and seed."""
    body = {"max_new_tokens": CHAT["max_tokens"], "sampling_seed": CHAT["seed"], **params}
    out = engine.generate({"input_ids": prompt_ids, "sampling_params": body, "return_logprob": True})
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def chatted(engine: RunningEngine, extra: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    answer = engine.post("/v1/chat/completions", {**CHAT, "return_token_ids": True, **extra})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    return choice["prompt_token_ids"], choice["response_token_ids"], logprobs


@pytest.mark.parametrize("unset", [{}, dict.fromkeys(("temperature", "top_p", "top_k", "min_p"))])
def test_a_chat_request_takes_the_models_recommended_values_for_those_it_leaves_unset(
    recommending_engine: RunningEngine, unset: dict[str, Any]
) -> None:
    """Left out or null (SGLang reads a null as unset). The recommended repetition_penalty is not taken (below)."""
    prompt_ids, tokens, logprobs = chatted(recommending_engine, unset)
    recommended = {k: v for k, v in MODEL_DEFAULTS.items() if k != "repetition_penalty"}
    expected_tokens, expected_logprobs = generated(recommending_engine, prompt_ids, recommended)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)


def test_a_chat_requests_own_values_win(recommending_engine: RunningEngine) -> None:
    prompt_ids, tokens, logprobs = chatted(recommending_engine, OPENAI_DEFAULTS)
    expected_tokens, expected_logprobs = generated(recommending_engine, prompt_ids, OPENAI_DEFAULTS)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)


def test_a_completion_keeps_the_openai_defaults(recommending_engine: RunningEngine) -> None:
    """SGLang's completions handler reads no model defaults: repetition_penalty stays 1.0, so no refusal either."""
    body = {"prompt": "1+1=", "max_tokens": 4, "seed": 7, "logprobs": 0, "return_token_ids": True}
    answer = recommending_engine.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    tokens, logprobs = generated(recommending_engine, choice["prompt_token_ids"], OPENAI_DEFAULTS)
    assert choice["token_ids"] == tokens
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-5)


def test_a_recommended_repetition_penalty_the_engine_cannot_apply_is_not_taken_and_said_so_at_start(
    recommending_engine: RunningEngine,
) -> None:
    """Taken as the default, 1.05 had every chat request that left repetition_penalty unset refused (this engine
    samples only without one); a request asking for it is still refused."""
    assert recommending_engine.post("/v1/chat/completions", CHAT).status_code == 200
    log = recommending_engine.process.log_path.read_text()
    assert "recommends repetition_penalty 1.05; chat requests are sampled without one (1.0)" in log
    asked = recommending_engine.post("/v1/chat/completions", {**CHAT, "repetition_penalty": 1.05})
    assert asked.status_code == 400
    assert "repetition_penalty=1.05 is not supported by rlfleet-engine (only 1.0)" in asked.json()["message"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"temperature": 0.7,', "not readable as JSON"),
        ("[0.7]", "must be a JSON object, got an array"),
        ('{"temperature": -1}', "temperature: Input should be greater than or equal to 0"),
        ('{"top_p": 1.5, "top_k": 0}', "top_p: Input should be less than or equal to 1; top_k: top_k must be -1"),
    ],
)
def test_a_generation_config_the_engine_cannot_read_stops_it_at_start_naming_the_problem(
    tiny_model_dir: Path, tmp_path: Path, text: str, problem: str
) -> None:
    model = model_with_generation_config(tiny_model_dir, tmp_path / "model", text)
    with pytest.raises(ServiceStartError) as refused:
        start_engine(model, tmp_path).process.stop()
    assert f"{model / 'generation_config.json'}: " in str(refused.value)
    assert problem in str(refused.value)
