"""`exact`: the whole response equals the label (by default after stripping surrounding whitespace)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlfleet_reward.reward_function import RewardFunction, RewardInput


class ExactParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strip: bool = Field(default=True, description="Ignore leading and trailing whitespace.")
    case_sensitive: bool = Field(default=True, description="Compare case; false folds both sides.")


def score_exact(sample: RewardInput, params: Mapping[str, Any]) -> float:
    response, label = sample.response, sample.label
    if params["strip"]:
        response, label = response.strip(), label.strip()
    if not params["case_sensitive"]:
        response, label = response.casefold(), label.casefold()
    return float(response == label)


EXACT = RewardFunction(
    fn=score_exact,
    inputs=frozenset({"response", "label"}),
    description="1.0 if the response equals the label (stripped; optionally ignoring case)",
    params=ExactParams,
    timeout_score=0.0,
)
