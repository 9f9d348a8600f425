"""The `sampling_params` object of a /generate request, with SGLang's names, defaults and ranges.

Unknown keys are ignored (SGLang clients send many); known SGLang parameters this engine does not
implement are accepted only at their neutral value, so a request is never silently sampled from a
different distribution than it asked for.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Below this a temperature means greedy decoding, as in SGLang.
GREEDY_TEMPERATURE = 1e-6
# `max_new_tokens: null` asks, as in SGLang, for as many tokens as the context leaves; the request's expansion
# clamps this to the room its prompt leaves.
UNTIL_CONTEXT = sys.maxsize
# A seed is 64 bits, as torch.Generator.manual_seed takes it.
MAX_SEED = 2**64 - 1

# SGLang parameter -> its neutral value; anything else is refused with a message naming it. None, and an empty
# string or container (`logit_bias: {}`, `json_schema: ""`), read as the parameter's absence, as in SGLang.
_UNSUPPORTED_AT_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
# Parameters whose null SGLang reads as their default (its SamplingParams.__post_init__), so a client may send
# `"temperature": null` for "the default".
_NULL_IS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "n", "ignore_eos", "skip_special_tokens", "no_stop_trim")


def without_nulls(data: object, fields: tuple[str, ...]) -> object:
    """A request body without those of `fields` it sets to null, so that they take their defaults, as SGLang reads
    a null there; anything but a JSON object is left for validation to refuse."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in fields}
    return data


class SamplingParams(BaseModel):
    """How to sample one completion. `temperature` 0 means greedy."""

    model_config = ConfigDict(extra="allow", frozen=True)

    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1)
    sampling_seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Seeds the request's own random generators (one per sample), so the same request samples the same tokens."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        return without_nulls(data, _NULL_IS_DEFAULT)

    @field_validator("max_new_tokens", mode="before")
    @classmethod
    def _null_budget_until_context(cls, value: object) -> object:
        return UNTIL_CONTEXT if value is None else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_as_list(cls, value: object) -> object:
        # SGLang drops null ids from the list, as it reads a null list.
        if value is None:
            return []
        return [t for t in value if t is not None] if isinstance(value, list) else value

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {value}")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingParams:
        extra = self.model_extra or {}
        for name, neutral in _UNSUPPORTED_AT_NEUTRAL.items():
            if name in extra and not _is_neutral(extra[name], neutral):
                raise ValueError(f"{name}={extra[name]!r} is not supported by rlfleet-engine (only {neutral!r})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _is_neutral(value: object, neutral: object) -> bool:
    return value is None or value == neutral or (isinstance(value, str | dict | list) and not value)
