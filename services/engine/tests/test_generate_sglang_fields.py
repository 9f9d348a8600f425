"""/generate fields whose meaning SGLang fixes: the ones this engine cannot honour are refused naming them, and
the prompt side of the logprobs has SGLang's shape.

In process, on the `sim` backend (no model); the answer shapes come from the code both backends share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.http_app import create_app
from rlfleet_engine.sim_backend import SimEngineCore


@pytest.fixture
def client() -> Iterator[TestClient]:
    registry = CollectorRegistry()
    core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), registry)
    with TestClient(create_app(core, registry)) as test_client:  # type: ignore[arg-type]
        yield test_client


def test_a_stop_regex_is_refused_naming_it(client: TestClient) -> None:
    """It was ignored: SGLang ends the output where the regex matches; here it ran to max_new_tokens."""
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 40, "stop_regex": "[a-z]"}}
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "stop_regex" in message and "not supported by rlfleet-engine" in message


@pytest.mark.parametrize("neutral", [None, []])
def test_an_absent_stop_regex_is_accepted(client: TestClient, neutral: Any) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "stop_regex": neutral}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"return_routed_experts": True}, "return_routed_experts"),
        ({"return_indexer_topk": True}, "return_indexer_topk"),
        ({"return_entropy": True}, "return_entropy"),
        ({"return_sampling_mask": True, "return_logprob": True}, "return_sampling_mask"),
        ({"return_sampling_mask": [False, True], "return_logprob": True}, "return_sampling_mask"),
        ({"session_params": {"id": "s1"}}, "session_params"),
        ({"positional_embed_overrides": {"positions": [0]}}, "positional_embed_overrides"),
    ],
)
def test_fields_asking_for_what_the_engine_cannot_give_are_refused_naming_them(
    client: TestClient, extra: dict[str, Any], field: str
) -> None:
    """They were ignored: a routing-replay client got no `routed_experts`, a session turn was answered without the
    session's context."""
    body = {"text": ["hi", "yo"], "sampling_params": {"max_new_tokens": 2}, **extra}
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == f"body: {field}: not supported by rlfleet-engine (leave out, or null)"


@pytest.mark.parametrize(
    "neutral",
    [
        {"return_routed_experts": False},
        {"return_entropy": None},
        {"session_params": None},
        {"return_sampling_mask": [False, False]},
        {"return_hidden_states": [False, False]},
        {"lora_path": [None, None]},
    ],
)
def test_those_fields_at_their_neutral_value_are_accepted(client: TestClient, neutral: dict[str, Any]) -> None:
    body = {"text": ["hi", "yo"], "sampling_params": {"max_new_tokens": 2}, **neutral}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert [o["meta_info"]["completion_tokens"] for o in response.json()] == [2, 2]


def test_prompt_logprobs_hold_sglangs_one_entry_for_the_last_prompt_token(client: TestClient) -> None:
    """SGLang's default logprob_start_len (-1) starts at the last prompt token: one entry `[null, id, text]`, and
    `[null]` of top logprobs. They were `[]`."""
    body = {
        "input_ids": [[104, 105], [120, 121, 122]],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 3, "n": 2},
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    outputs = response.json()
    assert [o["meta_info"]["input_token_logprobs"] for o in outputs] == [[[None, 105, "i"]]] * 2 + [
        [[None, 122, "z"]]
    ] * 2
    assert all(o["meta_info"]["input_top_logprobs"] == [None] for o in outputs)
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 3 for o in outputs)

    plain = client.post(
        "/generate", json={"text": "ab", "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    )
    meta = plain.json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ord("b"), None]], "text only with return_text_in_logprobs"
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
