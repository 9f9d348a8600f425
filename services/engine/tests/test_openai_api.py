"""The OpenAI-compatible endpoints, on the `sim` backend in process: SGLang's response shapes, streams, errors."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from engine_test_support import RunningEngine
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

from rlfleet.char_tokenizer import EOS, SPECIAL_TOKENS, UNK, vocabulary
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.http_app import create_app
from rlfleet_engine.sim_backend import SimEngineCore


@pytest.fixture
def client() -> Iterator[TestClient]:
    registry = CollectorRegistry()
    core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1, weight_version="3"), registry)
    with TestClient(create_app(core, registry)) as test_client:  # type: ignore[arg-type]
        yield test_client


# A Llama-2 / Mistral style template: it writes the BOS itself, and refuses the roles it does not know.
LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Conversation roles must be user, assistant or system') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def _llama_style_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny model's character tokenizer with a BOS post-processor, as Llama's has (<unk>, id 2, stands in
    for <s>): `encode` adds the BOS, and so does the chat template."""
    core = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{UNK} $A", special_tokens=[(UNK, 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=UNK, eos_token=EOS, unk_token=UNK, chat_template=LLAMA_STYLE_TEMPLATE
    )


@pytest.fixture
def llama_client() -> Iterator[TestClient]:
    registry = CollectorRegistry()
    core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), registry)
    # The sim runs whatever ids it is sent; only how the OpenAI layer tokenises prompts is under test.
    core.tokenizer = _llama_style_tokenizer()  # type: ignore[assignment]
    with TestClient(create_app(core, registry)) as test_client:  # type: ignore[arg-type]
        yield test_client


def test_completion_returns_text_logprobs_token_ids_and_usage(client: TestClient) -> None:
    body = {"prompt": "hello", "max_tokens": 4, "logprobs": 0, "return_token_ids": True, "rid": "r1", "x": 1}
    answer = client.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert answer["id"] == "r1" and answer["object"] == "text_completion"
    assert choice["prompt_token_ids"] == [ord(c) for c in "hello"]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"] == "".join(map(chr, choice["token_ids"]))
    assert len(choice["logprobs"]["token_logprobs"]) == 4 and choice["finish_reason"] == "length"
    assert answer["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip
    assert answer["metadata"] == {"weight_version": "3", "weight_versions": [{"version": "3", "start": 0, "end": 4}]}


def test_a_chat_choice_names_its_output_ids_as_sglang_does(client: TestClient) -> None:
    """SGLang's chat choice carries `response_token_ids` (a completion choice `token_ids`), and refuses them on a
    stream: a router reading `token_ids` lost every chat turn of a trajectory on SGLang, never here."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert len(choice["response_token_ids"]) == 3 and "token_ids" not in choice and choice["prompt_token_ids"]
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "return_token_ids is not supported with streaming" in streamed.text


def test_chat_with_n_samples_and_a_stream(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "n": 2, "logprobs": True})
    choices = answer.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and len(c["logprobs"]["content"]) == 3 for c in choices)
    streamed = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text) == 3 and chunks[-1]["usage"]["completion_tokens"] == 3
    # As SGLang's: content chunks carry no finish reason; a chunk of its own, with an empty delta, ends the choice.
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert choices[-1]["delta"] == {} and choices[-2]["delta"]["content"]


def test_a_streamed_completions_logprobs_offsets_run_through_the_whole_text(client: TestClient) -> None:
    body = {"prompt": "hello", "max_tokens": 6, "logprobs": 1, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    chunks = _events(client.post("/v1/completions", json={**body, "stream": True}))
    offsets = [
        o
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == whole["text_offset"] and offsets[-1] > 0


def _events(answer: Any) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_stream_never_sends_text_a_stop_string_takes_back(client: TestClient) -> None:
    plain = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 16}}).json()["text"]
    stop = plain[6:9]
    expected = plain[: plain.index(stop)]
    body = {"prompt": "hello", "max_tokens": 16, "stop": stop}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected

    deltas = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in deltas) == expected
    streamed = client.post(
        "/generate", json={"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 16, "stop": stop}}
    )
    texts = [chunk["text"] for chunk in _events(streamed)]  # cumulative
    assert texts[-1] == expected
    assert all(later.startswith(text) for text, later in itertools.pairwise(texts)), texts


def test_bad_requests_name_the_field(client: TestClient) -> None:
    answer = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert answer.status_code == 400 and "max_tokens" in answer.json()["message"]
    answer = client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert answer.status_code == 400 and "messages" in answer.json()["message"]
    answer = client.post("/v1/completions", json={"prompt": "x", "frequency_penalty": 0.5})
    assert answer.status_code == 400 and "frequency_penalty" in answer.text
    answer = client.post("/v1/completions", json={"prompt": "x", "logprobs": 257})  # MAX_TOP_LOGPROBS_NUM + 1
    assert answer.status_code == 400 and "body.logprobs: Input should be less than or equal to 256" in answer.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"temperature": -1}, "body.temperature: Input should be greater than or equal to 0"),
        (
            {"top_p": 0, "min_p": 2},
            "body.top_p: Input should be greater than 0; body.min_p: Input should be less than or equal to 1",
        ),
        ({"top_k": 0}, "body.top_k: top_k must be -1 (disabled) or at least 1, got 0"),
        ({"stop": [""]}, "body: stop strings must be non-empty"),
        ({"frequency_penalty": 0.5}, "body: frequency_penalty=0.5 is not supported by rlfleet-engine (only 0.0)"),
    ],
)
def test_a_sampling_parameter_out_of_range_is_refused_naming_the_openai_field(
    client: TestClient, route: str, extra: dict[str, object], message: str
) -> None:
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    for stream in (False, True):
        answer = client.post(route, json={**body, "max_tokens": 2, "stream": stream, **extra})
        assert answer.status_code == 400
        assert answer.json() == {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prompt": [97, 70000]}, "prompt holds token id 70000, outside the vocabulary [0, 65536)"),
        ({"prompt": [[97], [98, -1]]}, "prompt[1] holds token id -1, outside the vocabulary [0, 65536)"),
        ({"stop_token_ids": [70000]}, "stop_token_ids holds token id 70000, outside the vocabulary [0, 65536)"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_openai_field(
    client: TestClient, extra: dict[str, object], message: str
) -> None:
    """They were refused under /generate's names, `input_ids` and `sampling_params.stop_token_ids`."""
    for stream in (False, True):
        answer = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream, **extra})
        assert answer.status_code == 400
        assert answer.json()["message"] == message


@pytest.mark.parametrize(
    ("route", "body", "prompt_tokens"),
    [
        ("/generate", {"text": "abcd", "sampling_params": {"max_new_tokens": 40000}}, 4),
        ("/v1/completions", {"prompt": "abcd", "max_tokens": 40000}, 4),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 40000}, 26),
    ],
)
def test_a_request_reaching_the_context_is_refused_in_sglangs_words(
    client: TestClient, route: str, body: dict[str, object], prompt_tokens: int
) -> None:
    """Clients parse SGLang's message for the context, prompt and total; it was ours, naming max_new_tokens (a field
    an OpenAI client never sent)."""
    answer = client.post(route, json=body)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"] if route == "/generate" else answer.json()["message"]
    assert message == (
        "Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a total of "
        f"{prompt_tokens + 40000} tokens: {prompt_tokens} tokens from the input messages and 40000 tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the completion to fit within the "
        "limit."
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("ab", [[97, 98]]),
        ([97, 98], [[97, 98]]),
        (["ab", "c"], [[97, 98], [99]]),
        ([[97, 98], [99]], [[97, 98], [99]]),
    ],
)
def test_every_prompt_form_reaches_the_engine_as_token_ids(
    client: TestClient, prompt: object, expected: list[list[int]]
) -> None:
    answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    assert [c["prompt_token_ids"] for c in choices] == expected


def test_an_empty_prompt_list_is_refused(client: TestClient) -> None:
    answer = client.post("/v1/completions", json={"prompt": [], "max_tokens": 1})
    assert answer.status_code == 400 and "prompt: must not be empty" in answer.text


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {"prompt": "2+2="}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2="}]}),
    ],
)
def test_a_seed_draws_the_same_answer_again(engine: RunningEngine, route: str, body: dict[str, object]) -> None:
    def answer(seed: int) -> str:
        sampled = engine.post(route, {**body, "max_tokens": 12, "temperature": 1.0, "seed": seed})
        assert sampled.status_code == 200, sampled.text
        choice = sampled.json()["choices"][0]
        return str(choice["text"] if "text" in choice else choice["message"]["content"])

    first = answer(7)
    assert answer(7) == first
    assert {answer(seed) for seed in range(8, 12)} != {first}  # other seeds draw otherwise


def test_a_negative_seed_is_refused(client: TestClient) -> None:
    answer = client.post("/v1/completions", json={"prompt": "x", "seed": -1})
    assert answer.status_code == 400 and "seed" in answer.json()["message"]


@pytest.mark.parametrize(
    ("route", "extra", "field"),
    [
        ("/v1/completions", {"logit_bias": {"5": 100}}, "logit_bias"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": " and so on"}, "suffix"),
    ],
)
def test_a_constraint_the_engine_cannot_honour_is_refused_not_ignored(
    client: TestClient, route: str, extra: dict[str, object], field: str
) -> None:
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    answer = client.post(route, json={**body, "max_tokens": 2, **extra})
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["message"] and "not supported" in answer.json()["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_infinite_temperature_is_refused_as_sglang_refuses_it(client: TestClient, route: str) -> None:
    """JSON as Python writes it carries Infinity; it was sampled as a uniform draw."""
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    sent = json.dumps({**body, "max_tokens": 2, "temperature": float("inf")})
    answer = client.post(route, content=sent, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["message"] == "body.temperature: Input should be a finite number"


def test_a_chat_request_takes_null_sampling_fields_as_their_defaults(client: TestClient) -> None:
    """SGLang's chat request types them Optional (OpenAI's API allows null); each was a 400 here."""
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "repetition_penalty"))
    answer = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **nulls}
    )
    assert answer.status_code == 200, answer.text


def test_the_model_card_has_openais_fields(client: TestClient) -> None:
    card = client.get("/v1/models").json()["data"][0]
    assert isinstance(card["created"], int) and card["object"] == "model" and card["owned_by"]


def test_neutral_values_of_those_fields_pass(client: TestClient) -> None:
    messages = [{"role": "user", "content": "x"}]
    neutral = {"logit_bias": {}, "response_format": {"type": "text"}, "tools": [{"type": "function"}]}
    answer = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **neutral, "tool_choice": "none"}
    )
    assert answer.status_code == 200, answer.text
    answer = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "best_of": 2, "n": 2, "suffix": ""})
    assert answer.status_code == 200, answer.text


def test_top_logprobs_without_logprobs_is_refused(client: TestClient) -> None:
    messages = [{"role": "user", "content": "x"}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "top_logprobs": 3})
    assert answer.status_code == 400 and "top_logprobs needs logprobs" in answer.json()["message"], answer.text
    asked = {"messages": messages, "max_tokens": 2, "top_logprobs": 3, "logprobs": True}
    tops = client.post("/v1/chat/completions", json=asked).json()["choices"][0]["logprobs"]["content"][0]
    assert len(tops["top_logprobs"]) == 3


def test_a_chat_prompt_holds_the_bos_its_template_writes_once(llama_client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    # One BOS, then the template's text: what transformers' apply_chat_template(tokenize=True) gives.
    expected = [2, *(vocabulary()[c] for c in "user: hi\nassistant: ")]
    body = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
    answer = llama_client.post("/v1/chat/completions", json=body).json()
    assert answer["choices"][0]["prompt_token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)
    # A raw prompt has no template to write them: it gets the tokenizer's special tokens, as in the orchestrator.
    body = {"prompt": "hi", "max_tokens": 1, "return_token_ids": True}
    completion = llama_client.post("/v1/completions", json=body).json()
    assert completion["choices"][0]["prompt_token_ids"] == [2, vocabulary()["h"], vocabulary()["i"]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_conversation_the_chat_template_refuses_is_bad_input(llama_client: TestClient, stream: bool) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    answer = llama_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "stream": stream})
    assert answer.status_code == 400, answer.text  # not a 500, which the router would retry on other engines
    refusal = "Conversation roles must be user, assistant or system"
    assert answer.json() == {
        "object": "error",
        "message": f"messages: the model's chat template refused them: {refusal}",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_stream_is_named_as_the_whole_answer_is(client: TestClient, route: str, body: dict[str, Any]) -> None:
    body = {**body, "max_tokens": 2, "rid": "my-rid", "stream_options": {"include_usage": True}}
    assert client.post(route, json=body).json()["id"] == "my-rid"
    chunks = _events(client.post(route, json={**body, "stream": True}))
    assert {chunk["id"] for chunk in chunks} == {"my-rid"}
    # Several answers (here n=2) are one stream under one id, as they are one whole answer under one id.
    several = _events(client.post(route, json={**body, "n": 2, "stream": True}))
    assert len({chunk["id"] for chunk in several}) == 1 and len(several) > 2
