"""The OpenAI routes' SGLang fields: those the engine cannot honour are refused naming them (SGLang's BadRequestError
shape), the chat fields that shape the prompt reach it as SGLang's chat handler gives them to the template, and the
answer fields asked for are there.

In process, on the `sim` backend (no model); the answer shapes come from the code both backends share.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.http_app import create_app
from rlfleet_engine.sim_backend import SimEngineCore, SimTokenizer

COMPLETION = ("/v1/completions", {"prompt": "hello"})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})
# Between what the recording template wrote (JSON, which escapes a newline) and the text that follows it.
END_OF_TEMPLATE = "\n"


class RecordingTemplateTokenizer(SimTokenizer):
    """The sim's tokenizer with a chat template that writes, as JSON, the messages and keyword arguments it was
    rendered with: the prompt's ids, read back, show what the template saw."""

    chat_template = "records its input"

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tokenize: bool, add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        assert not tokenize and add_generation_prompt
        return json.dumps({"messages": messages, "kwargs": kwargs}) + END_OF_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text)


def _client(config: EngineConfig, tokenizer: SimTokenizer | None = None) -> TestClient:
    registry = CollectorRegistry()
    core = SimEngineCore(config, registry)
    if tokenizer is not None:
        core.tokenizer = tokenizer  # only how the OpenAI layer renders prompts is under test
    return TestClient(create_app(core, registry))  # type: ignore[arg-type]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with _client(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1)) as test_client:
        yield test_client


@pytest.fixture
def templated() -> Iterator[TestClient]:
    config = EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1)
    with _client(config, RecordingTemplateTokenizer()) as test_client:
        yield test_client


def _events(response: Any) -> list[dict[str, Any]]:
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def _seen_by_template(answer: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """What the recording template was rendered with, and the prompt's text after it."""
    text = SimTokenizer().decode(answer["choices"][0]["prompt_token_ids"])
    rendered, _, after = text.partition(END_OF_TEMPLATE)
    return json.loads(rendered), after


def test_a_stop_regex_is_refused_naming_it(client: TestClient) -> None:
    """It was ignored: SGLang ends the output where the regex matches; here it ran to max_tokens (200, 40 tokens)."""
    for route, body in (COMPLETION, CHAT):
        answer = client.post(route, json={**body, "max_tokens": 40, "stop_regex": "[a-z]"})
        assert answer.status_code == 400, answer.text
        assert answer.json() == {
            "object": "error",
            "message": "stop_regex: not supported by rlfleet-engine (leave out, or null)",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("route", "body", "extra", "field"),
    [
        (*COMPLETION, {"min_tokens": 5}, "min_tokens"),
        (*CHAT, {"min_tokens": 5}, "min_tokens"),
        (*COMPLETION, {"regex": "[0-9]+"}, "regex"),
        (*CHAT, {"ebnf": 'root ::= "a"'}, "ebnf"),
        (*COMPLETION, {"json_schema": '{"type": "object"}'}, "json_schema"),
        (*CHAT, {"lora_path": "adapter-1"}, "lora_path"),
        (*COMPLETION, {"lora_path": [None, "adapter-1"]}, "lora_path"),
        (*CHAT, {"return_hidden_states": True}, "return_hidden_states"),
        (*COMPLETION, {"return_hidden_states": "last"}, "return_hidden_states"),
        (*CHAT, {"return_routed_experts": True}, "return_routed_experts"),
        (*COMPLETION, {"custom_logit_processor": "{}"}, "custom_logit_processor"),
        (*CHAT, {"custom_params": {"k": 1}}, "custom_params"),
        (*CHAT, {"session_params": {"id": "s1"}}, "session_params"),
        (*COMPLETION, {"return_cached_tokens_details": True}, "return_cached_tokens_details"),
        (*CHAT, {"reasoning": {"effort": "low"}}, "reasoning"),
    ],
)
def test_fields_the_engine_cannot_honour_are_refused_naming_them(
    client: TestClient, route: str, body: dict[str, Any], extra: dict[str, Any], field: str, stream: bool
) -> None:
    """Each was ignored (200): a completion shorter than min_tokens, text outside the grammar, the base model's
    tokens for a LoRA adapter, an answer without the hidden states asked for."""
    answer = client.post(route, json={**body, "max_tokens": 3, "stream": stream, **extra})
    assert answer.status_code == 400, answer.text
    refusal = answer.json()
    assert refusal["type"] == "BadRequestError", refusal
    assert refusal["message"] == f"{field}: not supported by rlfleet-engine (leave out, or null)"


@pytest.mark.parametrize(
    "neutral",
    [
        {"stop_regex": None},
        {"stop_regex": []},
        {"min_tokens": 0},
        {"regex": ""},
        {"lora_path": [None]},
        {"return_hidden_states": False},
        {"custom_params": {}},
        {"reasoning": None},
    ],
)
def test_those_fields_at_their_neutral_value_are_accepted(client: TestClient, neutral: dict[str, Any]) -> None:
    for route, body in (COMPLETION, CHAT):
        answer = client.post(route, json={**body, "max_tokens": 2, **neutral})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("route", "body"), [COMPLETION, CHAT])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_content_chunk(
    client: TestClient, route: str, body: dict[str, Any]
) -> None:
    """It was ignored: no chunk carried usage. SGLang puts each choice's usage on its content chunks."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    sent = {**body, "max_tokens": 5, "n": 2, "stream": True, "stream_options": options}
    chunks = _events(client.post(route, json=sent))
    prompt_tokens = 5 if route == "/v1/completions" else len("<|user|>\nhello\n<|assistant|>\n")
    content = [c for c in chunks if c["choices"] and ("text" in c["choices"][0] or c["choices"][0]["delta"])]
    content = [c for c in content if c["choices"][0].get("delta", {}).get("role") is None]
    assert content
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in content if c["choices"][0]["index"] == index]
        assert counts and counts == sorted(counts) and counts[-1] == 5, counts
    for chunk in content:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    plain = _events(client.post(route, json={**sent, "stream_options": {"include_usage": True}}))
    assert all("usage" not in c for c in plain[:-1])


def test_a_chat_without_a_budget_runs_to_the_context_as_sglangs_does() -> None:
    """SGLang's chat sends max_new_tokens null (max_completion_tokens or max_tokens), which runs to the context;
    here it stopped at /generate's 128 tokens with finish_reason 'length'."""
    config = EngineConfig(model_path="sim", sim_decode_ms_per_step=0.01, context_length=300)
    with _client(config) as test_client:
        answer = test_client.post(CHAT[0], json=CHAT[1])
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["completion_tokens"] > 128
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 300 - 2  # the room SGLang's scheduler leaves
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        # Either field bounds it.
        for field in ("max_tokens", "max_completion_tokens"):
            bounded = test_client.post(CHAT[0], json={**CHAT[1], field: 3}).json()
            assert bounded["usage"]["completion_tokens"] == 3


def test_a_completion_refuses_a_null_max_tokens_as_sglangs_does(client: TestClient) -> None:
    """SGLang's completion types max_tokens `int`: a null is refused. Here it ran to /generate's 128 tokens."""
    answer = client.post(COMPLETION[0], json={**COMPLETION[1], "max_tokens": None})
    assert answer.status_code == 400, answer.text
    assert "max_tokens" in answer.json()["message"]
    assert client.post(COMPLETION[0], json=COMPLETION[1]).json()["usage"]["completion_tokens"] == 16


def test_an_assistants_tool_calls_and_a_tools_answer_reach_the_template(templated: TestClient) -> None:
    """They were dropped (role and content only): the model read a conversation in which it never called a tool.
    SGLang gives the template every message field, an assistant's tool call arguments parsed into an object."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1, "y": 2}'}}
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "use the tool"},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "3"},
    ]
    answer = templated.post(CHAT[0], json={"messages": messages, "max_tokens": 1, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    seen, after = _seen_by_template(answer.json())
    assert seen["messages"] == [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "add", "arguments": {"x": 1, "y": 2}}}],
            "reasoning_content": "use the tool",
        },
        {"role": "tool", "content": "3", "tool_call_id": "call_1", "name": "add"},
    ]
    assert after == ""


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("{not json", "Assistant tool call function.arguments must be valid JSON."),
        ("[1, 2]", "Assistant tool call function.arguments must be a JSON object."),
    ],
)
def test_tool_call_arguments_that_are_no_json_object_are_refused_in_sglangs_words(
    templated: TestClient, arguments: str, message: str
) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]
    answer = templated.post(CHAT[0], json={"messages": [*messages, {"role": "user", "content": "r"}], "max_tokens": 1})
    assert answer.status_code == 400, answer.text
    assert answer.json()["message"] == f"messages: {message}"
    assert answer.json()["type"] == "BadRequestError"


def test_continue_final_message_continues_the_last_assistant_message(templated: TestClient) -> None:
    """It was ignored: the last assistant message was rendered as a finished turn and a new one begun. SGLang renders
    the messages before it with the generation prompt and appends its text; without the flag it renders it as a
    user's message."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    body = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
    seen, after = _seen_by_template(templated.post(CHAT[0], json={**body, "continue_final_message": True}).json())
    assert seen["messages"] == [{"role": "user", "content": "Count."}] and after == "One, two,"
    seen, after = _seen_by_template(templated.post(CHAT[0], json=body).json())
    assert seen["messages"] == [{"role": "user", "content": "Count."}, {"role": "user", "content": "One, two,"}]
    assert after == ""


def test_continue_final_message_without_a_template_continues_the_plain_layout(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "max_tokens": 1, "return_token_ids": True, "continue_final_message": True}
    ids = client.post(CHAT[0], json=body).json()["choices"][0]["prompt_token_ids"]
    assert SimTokenizer().decode(ids) == "<|user|>\nhi\n<|assistant|>\nHel"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(templated: TestClient) -> None:
    """They were ignored: Qwen3's template, asked `enable_thinking: false`, went on thinking."""
    body = {**CHAT[1], "max_tokens": 1, "return_token_ids": True}
    seen, _ = _seen_by_template(templated.post(CHAT[0], json=body).json())
    assert seen["kwargs"] == {}
    kwargs = {"enable_thinking": False, "custom": [1]}
    seen, _ = _seen_by_template(templated.post(CHAT[0], json={**body, "chat_template_kwargs": kwargs}).json())
    assert seen["kwargs"] == kwargs
    # As SGLang: the effort goes to the template, and thinking is on unless it is "none"; the kwargs sent win.
    seen, _ = _seen_by_template(templated.post(CHAT[0], json={**body, "reasoning_effort": "none"}).json())
    assert seen["kwargs"] == {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}
    sent = {**body, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    seen, _ = _seen_by_template(templated.post(CHAT[0], json=sent).json())
    assert seen["kwargs"] == {"reasoning_effort": "high", "thinking": True, "enable_thinking": False}


def test_a_chats_input_ids_are_the_prompt(templated: TestClient) -> None:
    """They were ignored and the messages rendered: SGLang sends the ids as they are."""
    body = {**CHAT[1], "input_ids": [104, 105, 33], "max_tokens": 2, "return_token_ids": True}
    answer = templated.post(CHAT[0], json=body).json()
    assert answer["choices"][0]["prompt_token_ids"] == [104, 105, 33]
    assert answer["usage"]["prompt_tokens"] == 3
    outside = templated.post(CHAT[0], json={**body, "input_ids": [70000]})
    assert outside.status_code == 400 and "input_ids" in outside.json()["message"], outside.text


def test_return_prompt_token_ids_and_return_meta_info_are_answered(client: TestClient) -> None:
    """They were ignored: the choice had neither."""
    body = {**CHAT[1], "max_tokens": 2, "return_prompt_token_ids": True, "return_meta_info": True, "rid": "m1"}
    choice = client.post(CHAT[0], json=body).json()["choices"][0]
    assert SimTokenizer().decode(choice["prompt_token_ids"]) == "<|user|>\nhello\n<|assistant|>\n"
    assert choice["meta_info"]["id"] == "m1" and choice["meta_info"]["completion_tokens"] == 2
    assert "response_token_ids" not in choice
    for field in ("return_prompt_token_ids", "return_meta_info"):
        streamed = client.post(CHAT[0], json={**CHAT[1], "max_tokens": 2, "stream": True, field: True})
        assert streamed.status_code == 400, streamed.text
        assert streamed.json()["message"] == (
            f"{field} is not supported with streaming. Please set stream=false when using {field}=true."
        )


@pytest.mark.parametrize(
    ("tool_choice", "message"),
    [
        ("required", "Tools cannot be empty if tool choice is set to required."),
        (
            {"type": "function", "function": {"name": "f"}},
            "Tools cannot be empty if tool choice is set to a specific tool.",
        ),
    ],
)
def test_a_tool_choice_without_tools_is_refused_in_sglangs_words(
    client: TestClient, tool_choice: Any, message: str
) -> None:
    """It was answered (200) with no tool call at all."""
    answer = client.post(CHAT[0], json={**CHAT[1], "max_tokens": 2, "tool_choice": tool_choice})
    assert answer.status_code == 400, answer.text
    assert answer.json()["message"] == message and answer.json()["type"] == "BadRequestError"
