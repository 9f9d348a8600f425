"""`multiple_choice`: the option letter the response chose equals the label's.

The choice is read, in order of preference, from the last "answer is (B)" / "Answer: B" (markdown
emphasis around them allowed: "**Answer:** B"), the last
`\\boxed{B}`, a response that is only a letter ("B", "(B)", "B."), or the last parenthesized letter.
Only letters among `choices` count.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored


class ChoiceParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    choices: str = Field(default="ABCDEFGHIJ", pattern=r"^[A-Z]+$", description="The option letters, upper case.")


def chosen(response: str, choices: str) -> str | None:
    letter = f"[{choices}]"
    patterns = (
        # Markdown emphasis may wrap the word, the colon or the letter: "**Answer:** B", "answer is **(C)**".
        rf"(?i:answer)[*_]*\s*(?:(?i:is)|:)?[*_]*\s*:?\s*[*_]*\(?({letter})\)?[*_]*(?![A-Za-z])",
        rf"\\boxed\{{\s*\(?({letter})\)?\s*\}}",
        rf"^\s*\(?({letter})[).:]?\s*$",
        rf"\(({letter})\)",
    )
    for pattern in patterns:
        found = re.findall(pattern, response)
        if found:
            return found[-1]
    return None


def score_multiple_choice(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    gold = chosen(sample.label.strip().upper(), params["choices"])
    if gold is None:
        raise ValueError(f"the label {sample.label[:40]!r} is not one of the choices {params['choices']}")
    answer = chosen(sample.response, params["choices"])
    return Scored(score=float(answer == gold), parts={"found": float(answer is not None)})


MULTIPLE_CHOICE = RewardFunction(
    fn=score_multiple_choice,
    inputs=frozenset({"response", "label"}),
    description="1.0 if the option letter the response chose is the label's",
    params=ChoiceParams,
)
