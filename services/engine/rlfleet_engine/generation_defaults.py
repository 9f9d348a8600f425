"""The sampling defaults a model's generation_config.json recommends, which chat requests take.

SGLang (`--sampling-defaults model`, its default) gives a /v1/chat/completions request that leaves temperature,
top_p, top_k, min_p or repetition_penalty unset the value the model's generation_config.json holds, else the OpenAI
default; /v1/completions and /generate keep their own defaults. Only these five fields are read (`do_sample` and
the rest are not, as in SGLang). A model without the file has no defaults of its own; a file that is not JSON, or
holds one of the five out of range, stops the engine at start naming it: SGLang ignores an unreadable file and
refuses every chat request over a bad value, and either would go unnoticed until requests sample or fail.

This engine samples without a repetition penalty (a request asking for one is refused), so a recommended
repetition_penalty other than 1 is not taken, with a warning at start: taken, it would have every chat request
that leaves the field unset refused (Qwen2.5's instruct models recommend 1.05).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlfleet.http_errors import JSON_TYPE_NAMES
from rlfleet_engine.body_errors import describe

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


class ChatSamplingDefaults(BaseModel):
    """The fields of generation_config.json a chat request takes as defaults, in the ranges SGLang samples with."""

    model_config = ConfigDict(extra="ignore")

    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.0, le=2.0)

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int | None) -> int | None:
        if value is not None and (value == 0 or value < -1):
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {value}")
        return value


def read_chat_sampling_defaults(model_path: str) -> dict[str, float]:
    """The defaults `model_path`'s generation_config.json sets that this engine samples with (none when the file is
    absent); ValueError naming
    the file and what is wrong with it when it is not JSON, not an object, or holds a value out of range."""
    path = Path(model_path) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc}); fix the file or remove it") from exc
    if not isinstance(data, dict):
        got = "null" if data is None else JSON_TYPE_NAMES.get(type(data), type(data).__name__)
        raise ValueError(f"{path}: must be a JSON object, got {got}; fix the file or remove it")
    try:
        defaults = ChatSamplingDefaults.model_validate(data)
    except ValidationError as exc:
        raise ValueError(
            f"{path}: {describe(exc.errors())} (chat requests take it as their default); fix the value or remove it"
        ) from exc
    values = defaults.model_dump(exclude_none=True)
    penalty = values.pop("repetition_penalty", 1.0)
    if penalty != 1.0:
        logger.warning(
            "%s recommends repetition_penalty %g; chat requests are sampled without one (1.0), as this engine "
            "samples only so (a request asking for another is refused)",
            path,
            penalty,
        )
    return values
