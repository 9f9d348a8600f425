"""`f1`: token-overlap F1 between the response and the label (SQuAD-style normalization).

Both sides are lowercased, punctuation and the articles a/an/the are dropped, and whitespace splits
tokens. A label that is a JSON list of strings gives several references; the best F1 counts.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Mapping
from typing import Any

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def f1(prediction: list[str], reference: list[str]) -> tuple[float, float, float]:
    """(f1, precision, recall); two empty token lists agree fully."""
    if not prediction or not reference:
        same = float(prediction == reference)
        return same, same, same
    common = sum((Counter(prediction) & Counter(reference)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(prediction), common / len(reference)
    return 2 * precision * recall / (precision + recall), precision, recall


def references(label: str) -> list[str]:
    if label.lstrip().startswith("["):
        try:
            parsed = json.loads(label)
        except json.JSONDecodeError:
            return [label]
        if isinstance(parsed, list) and parsed and all(isinstance(item, str) for item in parsed):
            return parsed
    return [label]


def score_f1(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    prediction = tokens(sample.response)
    best = max(f1(prediction, tokens(reference)) for reference in references(sample.label))
    return Scored(score=best[0], parts={"precision": best[1], "recall": best[2]})


F1 = RewardFunction(
    fn=score_f1,
    inputs=frozenset({"response", "label"}),
    description="token-overlap F1 of the response against the label (or the best of a JSON list of labels)",
    timeout_score=0.0,
)
