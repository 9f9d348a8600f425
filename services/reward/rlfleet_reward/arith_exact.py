"""`arith_exact`: the arithmetic task's reward (1.0 when the answer line is the label's integer).

The answer is the response up to its first newline (or its end), stripped. It must be a plain
integer (`-?digits`, optional `+`); leading zeros are allowed, as for any integer literal. Numbers
are compared as normalized digit strings rather than through `int()`, so the cost stays linear in
the response length and a huge answer cannot trip Python's int-conversion limit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlfleet_reward.reward_function import RewardFunction, RewardInput

_INTEGER = re.compile(r"([+-]?)([0-9]+)")


def _normalize(text: str) -> str | None:
    """`"+007"` -> `"7"`, `"-0"` -> `"0"`; None when `text` is not an integer literal."""
    match = _INTEGER.fullmatch(text)
    if match is None:
        return None
    sign, digits = match.groups()
    digits = digits.lstrip("0") or "0"
    return "-" + digits if sign == "-" and digits != "0" else digits


def score_arith_exact(sample: RewardInput, params: Mapping[str, Any]) -> float:
    label = _normalize(sample.label.strip())
    if label is None:
        raise ValueError(f"label {sample.label[:40]!r} is not an integer")
    answer = _normalize(sample.response.split("\n", 1)[0].strip())
    return 1.0 if answer == label else 0.0


ARITH_EXACT = RewardFunction(
    fn=score_arith_exact,
    inputs=frozenset({"response", "label"}),
    description="1.0 if the response's first line, stripped, is the label's integer; else 0.0",
    timeout_score=0.0,
)
