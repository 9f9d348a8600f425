"""Refusals in the status and body shape SGLang gives them on each route, and GET /v1/models/{model}, on a live
engine: SGLang's /generate answers a bad sampling value or a missing prompt `{"error": {"message"}}` (its
handler's ValueError), a top-level field of the wrong type `{"object": "error", ...}` (FastAPI's validation); its
OpenAI routes answer a value they refuse `{"object": "error", "type": "BadRequestError", ...}`."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from engine_test_support import RunningEngine

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"text": "1+1=", "sampling_params": {"temperature": -1}},
            "body.sampling_params.temperature: Input should be greater than or equal to 0",
        ),
        ({"text": "1+1=", "sampling_params": {"top_p": 2}}, "body.sampling_params.top_p: Input should be less than"),
        ({"text": ["a", "b"], "sampling_params": [{}, {"top_k": 0}]}, "body.sampling_params.1.top_k: top_k must be"),
        ({"text": "1+1=", "sampling_params": {"stop": [""]}}, "body.sampling_params: stop strings must be non-empty"),
        ({"text": "1+1=", "sampling_params": {"temperature": "hot"}}, "body.sampling_params.temperature: "),
        ({"text": "1+1=", "sampling_params": {"temperature": float("inf")}}, "body.sampling_params.temperature: "),
        ({"text": "1+1=", "sampling_params": {"max_new_tokens": -3}}, "body.sampling_params.max_new_tokens: "),
        ({"sampling_params": {"max_new_tokens": 2}}, "body: provide the prompt as either text or input_ids (got"),
        ({"text": "1+1=", "input_ids": [5]}, "body: provide the prompt as either text or input_ids, not both"),
    ],
)
def test_generate_answers_a_bad_value_as_sglangs_handler_does(
    engine: RunningEngine, body: dict[str, Any], message: str
) -> None:
    # Sent as Python's JSON writes it: `Infinity` for a float that is not finite.
    headers = {"content-type": "application/json"}
    answer = httpx.post(engine.url + "/generate", content=json.dumps(body), headers=headers, timeout=30)
    assert answer.status_code == 400, answer.text
    assert set(answer.json()) == {"error"}, answer.text
    assert answer.json()["error"]["message"].startswith(message), answer.text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": 5}, "body.text: Input should be a valid string"),
        ({"text": "1+1=", "sampling_params": "hot"}, "body.sampling_params: "),
        ({"text": "1+1=", "stream": "sometimes", "sampling_params": {"top_p": 2}}, "body.stream: "),
    ],
)
def test_generate_answers_a_field_of_the_wrong_type_as_fastapis_validation_does(
    engine: RunningEngine, body: dict[str, Any], message: str
) -> None:
    answer = engine.post("/generate", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert (error["object"], error["type"], error["param"], error["code"]) == ("error", "Bad Request", None, 400)
    assert message in error["message"], error["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"temperature": -1}, "body.temperature: Input should be greater than or equal to 0"),
        ({"top_p": 2}, "body.top_p: Input should be less than or equal to 1"),
    ],
)
def test_openai_routes_answer_a_bad_value_as_sglangs_openai_handlers_do(
    engine: RunningEngine, route: str, stream: bool, extra: dict[str, Any], message: str
) -> None:
    prompt = {"prompt": "1+1="} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    answer = engine.post(route, {**prompt, "max_tokens": 2, "stream": stream, **extra})
    assert answer.status_code == 400, answer.text
    expected = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
    assert answer.json() == expected


def test_a_model_is_retrieved_by_its_served_name(start_sim: Callable[..., str]) -> None:
    name = "Qwen/Qwen2.5-0.5B-Instruct"  # a Hugging Face id: the path holds a slash
    url = start_sim("--served-model-name", name, "--context-length", "4096")
    listed = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    answer = httpx.get(f"{url}/v1/models/{name}", timeout=10)
    assert answer.status_code == 200, answer.text
    card = answer.json()
    assert {**card, "created": 0} == {**listed, "created": 0}
    assert (card["id"], card["object"], card["max_model_len"]) == (name, "model", 4096)


def test_an_unknown_model_is_openais_404(start_sim: Callable[..., str]) -> None:
    url = start_sim("--served-model-name", "policy")
    for unknown in ("gpt-4o", "policy/extra", "a b"):
        answer = httpx.get(f"{url}/v1/models/{urllib.parse.quote(unknown)}", timeout=10)
        assert answer.status_code == 404, answer.text
        assert answer.json() == {
            "error": {
                "message": f"The model '{unknown}' does not exist; this engine serves 'policy'",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
