"""Request bodies of the OpenAI-compatible endpoints, with the fields and defaults of SGLang's OpenAI server.

Unknown fields are ignored (clients send many); the SGLang extensions that matter for RL rollouts are
read: `rid`, `return_token_ids` (prompt and completion token ids in every choice), `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `no_stop_trim`, and for chat `input_ids`,
`continue_final_message`, `chat_template_kwargs`, `reasoning_effort` and `return_prompt_token_ids`. Penalties
and the other sampling knobs go on to `SamplingParams`, which refuses any value it cannot honour. So are the fields
that constrain the answer and this engine cannot honour (`logit_bias`, a `response_format` other than text,
`tools`): refused, naming the field, rather than answered without the constraint; and the other SGLang fields that
change what is generated or answered (`unsupported_fields`: `stop_regex`, `min_tokens`, `regex`, `lora_path`,
`return_hidden_states`, ...), refused past validation as SGLang's handlers refuse a request.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet_engine.request_expansion import MAX_TOP_LOGPROBS_NUM
from rlfleet_engine.sampling_params import MAX_SEED, without_nulls
from rlfleet_engine.schemas import UnicodeStr, is_set

# Fields of SGLang's CompletionRequest and ChatCompletionRequest that change what is generated or answered and that
# this engine cannot honour: a stop at a regex match, a floor on the output's length, a grammar, a LoRA adapter, a
# logit processor, a session's context, hidden states, routed experts or per-source cached tokens in the answer.
# Refused when set (null, false, 0 and empty read as absent, as SGLang reads them), not answered without them.
_UNSUPPORTED_FIELDS = (
    "stop_regex",
    "min_tokens",
    "regex",
    "ebnf",
    "custom_params",
    "custom_logit_processor",
    "lora_path",
    "session_params",
    "return_hidden_states",
    "return_routed_experts",
    "return_cached_tokens_details",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """Usage (of the chunk's choice so far) on every content chunk, as SGLang sends it."""


class OpenAISampling(BaseModel):
    """Fields the two endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: UnicodeStr = "default"
    max_tokens: int | None = Field(default=None, gt=0)
    n: int = Field(default=1, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Seeds the request's own sampling (SGLang's `sampling_seed`): the same seed draws the same tokens."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: UnicodeStr | list[UnicodeStr] | None = None
    return_token_ids: bool = False
    # Read only to be refused: each changes what may be sampled, and ignoring it would hand back an answer
    # that silently breaks the constraint (SGLang honours both).
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported by rlfleet-engine")
        return bias

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format of type {kind!r} is not supported by rlfleet-engine (only 'text')")
        return response_format

    def sampling_params(self) -> dict[str, Any]:
        """The /generate `sampling_params` these fields ask for (max_new_tokens only when given)."""
        params: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        if self.max_tokens is not None:
            params["max_new_tokens"] = self.max_tokens
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    def unsupported_fields(self) -> list[str]:
        """The fields sent that ask for what this engine cannot honour (`_UNSUPPORTED_FIELDS`, and the route's own)."""
        extra = self.model_extra or {}
        return [name for name in (*_UNSUPPORTED_FIELDS, *self.ROUTE_UNSUPPORTED) if is_set(extra.get(name))]

    ROUTE_UNSUPPORTED: ClassVar[tuple[str, ...]] = ()


class CompletionRequest(OpenAISampling):
    """POST /v1/completions. SGLang's default budget for completions is 16 tokens."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, gt=0)
    """SGLang's completion types it `int` (a null is refused); its chat takes null for "until the context"."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_NUM)
    echo: bool = False
    # Read only to be refused when they ask for something: the best `n` of `best_of` samples, a text after the
    # completion to fill in. Answered without them, the completion would not be what they ask for.
    best_of: int | None = None
    suffix: str | None = None

    ROUTE_UNSUPPORTED = ("json_schema",)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo=true is not supported by rlfleet-engine")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported by rlfleet-engine")
        return suffix

    @model_validator(mode="after")
    def _best_of_n_only(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of {self.best_of} other than n ({self.n}) is not supported by rlfleet-engine")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; of a list of parts, the text parts joined (images and audio are not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


# Chat fields SGLang takes as null, for "the default" (its ChatCompletionRequest types them Optional; a completion
# request's are not).
_CHAT_NULL_IS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ChatCompletionRequest(OpenAISampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    input_ids: list[int] | None = Field(default=None, min_length=1)
    """The prompt's ids, as SGLang takes them: sent as they are, the messages not rendered."""
    continue_final_message: bool = False
    """A last assistant message is the start of the answer, continued; without this SGLang renders it as a user's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Passed to the chat template (Qwen3's `enable_thinking`, ...)."""
    reasoning_effort: str | float | None = None
    """Passed to the chat template, and its `thinking` / `enable_thinking` default to whether it is other than
    "none", as SGLang does."""
    return_prompt_token_ids: bool = False
    """The prompt's ids in each choice, as `prompt_token_ids` (not with a stream, as in SGLang)."""
    return_meta_info: bool = False
    """The output's `meta_info` in each choice (not with a stream, as in SGLang)."""

    # SGLang reads `reasoning` ({"effort", "enabled"}) into reasoning_effort and the template's kwargs.
    ROUTE_UNSUPPORTED = ("reasoning",)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        return without_nulls(data, _CHAT_NULL_IS_DEFAULT)

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> ChatCompletionRequest:
        # As OpenAI's API: top_logprobs alone would be answered with no logprobs at all.
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _no_tools(self) -> ChatCompletionRequest:
        # The model would never see them (the prompt is rendered without them) and no tool call is parsed.
        if self.tools and self.tool_choice != "none":
            raise ValueError("tools are not supported by rlfleet-engine: leave them out, or set tool_choice 'none'")
        return self

    def tool_choice_problem(self) -> str | None:
        """What SGLang's chat handler says of a tool choice that names tools the request does not give."""
        if self.tools:
            return None
        if isinstance(self.tool_choice, str) and self.tool_choice.lower() == "required":
            return "Tools cannot be empty if tool choice is set to required."
        if isinstance(self.tool_choice, dict):
            return "Tools cannot be empty if tool choice is set to a specific tool."
        return None

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with besides the messages, as SGLang's chat handler gives it."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            thinking = self.reasoning_effort != "none"
            kwargs.setdefault("thinking", thinking)
            kwargs.setdefault("enable_thinking", thinking)
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    def sampling_params(self) -> dict[str, Any]:
        params = super().sampling_params()
        # As SGLang's chat: without either, the answer may run to the context (or an eos), not to a default budget.
        params["max_new_tokens"] = self.max_completion_tokens or self.max_tokens
        return params
