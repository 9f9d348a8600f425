"""`format`: 1.0 when the response has the required shape, by a regular expression.

The default asks for `<think>...</think>` then `<answer>...</answer>` and nothing else. The pattern
is compiled when the request is validated, so a bad one is refused before anything is scored; a
pattern that backtracks forever is stopped by the item's time limit like any other function.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlfleet_reward.reward_function import RewardFunction, RewardInput
from rlfleet_reward.spec_regex import MAX_PATTERN_CHARS, compiled

THINK_ANSWER = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


class FormatParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pattern: str = Field(default=THINK_ANSWER, max_length=MAX_PATTERN_CHARS, description="A Python regular expression.")
    mode: Literal["fullmatch", "search"] = Field(
        default="fullmatch", description="`fullmatch`: the whole response; `search`: anywhere in it."
    )
    dotall: bool = Field(default=True, description="`.` matches newlines too.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        compiled(pattern)
        return pattern


def score_format(sample: RewardInput, params: Mapping[str, Any]) -> float:
    pattern = re.compile(params["pattern"], re.DOTALL if params["dotall"] else 0)
    match = pattern.fullmatch if params["mode"] == "fullmatch" else pattern.search
    return float(match(sample.response) is not None)


FORMAT = RewardFunction(
    fn=score_format,
    inputs=frozenset({"response"}),
    description="1.0 if the response matches a regular expression (default: <think>...</think><answer>...</answer>)",
    params=FormatParams,
    timeout_score=0.0,
)
