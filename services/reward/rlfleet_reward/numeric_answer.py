"""`numeric`: the response's last number (or the whole response) within a tolerance of the label's.

Numbers may carry a sign (the ASCII `-` or the Unicode minus `−` that typeset text uses; not right after a digit,
where it is a range's dash or a subtraction: `5-10` ends in 10), thousands separators (`1,234`; a comma elsewhere,
as in `1,2,3` or `12,5`, is no number), decimals, an exponent, or be a fraction `3/4`. The comparison is
`math.isclose(answer, label, rel_tol, abs_tol)`: by default relative only (1e-9), so a label of any magnitude
is matched to its own digits, and a label of 0 by 0 alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored

_MINUS = "\u2212"
# A sign is one only where no digit precedes it: the dash of `5-10` is a range's, the minus of `12-7` a subtraction's.
_SIGN = r"(?:(?<!\d)[-+\u2212])?"
_NUMBER = re.compile(
    rf"{_SIGN}(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?(?:/\d+)?|{_SIGN}\.\d+(?:[eE][-+]?\d+)?"
)


class NumericParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    abs_tol: float = Field(
        default=0.0,
        ge=0,
        description="Absolute tolerance; none by default, as it would accept any answer near 0 for a label smaller "
        "than it (0 for 6.626e-34).",
    )
    rel_tol: float = Field(default=1e-9, ge=0, description="Relative tolerance.")
    extract: Literal["last", "whole"] = Field(
        default="last", description="`last`: the last number in the response; `whole`: the stripped response."
    )


def to_number(text: str) -> float | None:
    """`text` as a number, None if it is none; a comma only between groups of three digits (a list `1,2,3` or a
    decimal comma `12,5` is no number, not 123 or 125)."""
    if "," in text and not _NUMBER.fullmatch(text):
        return None
    text = text.replace(",", "").replace(_MINUS, "-")
    try:
        return float(Fraction(text)) if "/" in text else float(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def score_numeric(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    gold = to_number(sample.label.strip())
    if gold is None or not math.isfinite(gold):
        raise ValueError(f"the label {sample.label[:60]!r} is not a number")
    if params["extract"] == "whole":
        answer = to_number(sample.response.strip())
    else:
        numbers = _NUMBER.findall(sample.response)
        answer = to_number(numbers[-1]) if numbers else None
    correct = answer is not None and math.isclose(answer, gold, rel_tol=params["rel_tol"], abs_tol=params["abs_tol"])
    return Scored(score=float(correct), parts={"found": float(answer is not None)})


NUMERIC = RewardFunction(
    fn=score_numeric,
    inputs=frozenset({"response", "label"}),
    description="1.0 if the response's last number is within tolerance of the label's number",
    params=NumericParams,
    timeout_score=0.0,
)
