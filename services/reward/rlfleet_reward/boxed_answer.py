"""`boxed`: the response's last `\\boxed{...}` answer compared with the label, after light LaTeX normalization.

Braces are matched, so `\\boxed{\\frac{1}{2}}` yields `\\frac{1}{2}`. The label may be boxed itself or
plain. Normalization drops `$`, spacing commands (`\\!`, `\\,`, `\\;`, `\\ `), `\\left`/`\\right`,
`^\\circ`, `\\text{...}` wrappers, whitespace and a trailing period, and reads `\\dfrac`/`\\tfrac` as
`\\frac`; it is string equality after that, not symbolic equivalence (that is the `math` function).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_DROPPED = re.compile(r"\\[!,;: ]|\\left|\\right|\^\{?\\circ\}?|\s+|\$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\boxed x`), braces matched; None without one."""
    for match in reversed(list(_BOXED.finditer(text))):
        rest = text[match.end() :]
        if not rest.startswith("{"):
            token = rest.split("$", 1)[0].split()
            if token:
                return token[0]
            continue
        depth = 0
        for i, char in enumerate(rest):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                return rest[1:i]
    return None


def normalize(answer: str) -> str:
    answer = _TEXT.sub(r"\1", answer)
    answer = _DROPPED.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return answer.rstrip(".")


def score_boxed(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    gold = last_boxed(sample.label)
    gold = normalize(sample.label if gold is None else gold)
    if not gold:
        raise ValueError(f"the label {sample.label[:60]!r} has no answer")
    answer = last_boxed(sample.response)
    correct = answer is not None and normalize(answer) == gold
    return Scored(score=float(correct), parts={"found": float(answer is not None)})


BOXED = RewardFunction(
    fn=score_boxed,
    inputs=frozenset({"response", "label"}),
    description="1.0 if the response's last \\boxed{} answer equals the label after LaTeX normalization",
)
