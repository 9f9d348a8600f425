"""`multiple_choice`: the option letter the response chose equals the label's.

When the response has a `</think>`, only what follows the last one is read: a choice inside the reasoning is a
draft. The choice is read, in order of preference, from the last `\\boxed{B}` (or `\\boxed{\\text{B}}`), the last
"answer is (B)" / "Answer: B" (markdown emphasis around them allowed: "**Answer:** B"; the letter may be named
"option B" and written as math or text, `$B$`, `\\(B\\)`, `\\text{B}`, or in brackets `[B]`), a response that is
only a letter ("B", "(B)", "B."), the last parenthesized letter, a letter that ends the response ("... so it is
B."), the last "B is correct" / "B is the right one" (after those: "Statement I is correct, so (B)" is B), or a
letter opening the response with its option's text ("B) 42", "C. The area doubles"). Only letters among `choices`
count. After "answer is" the letter is the choice ("the answer is A as shown above"). `A` and `I` are also words:
after "Answer:", one followed on its line by a lower-case word ("Answer: I think it is B", "Answer: A careful
reading gives C") starts a sentence and is not the choice, nor is a letter opening a contraction ("I'm"), unless
that word is one the article "A" or the pronoun "I" cannot be followed by ("Answer: A is correct", "Answer: I
because ..."). Other letters are not words, so "Answer: B because ..." is B.
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


CHOICE_FOLLOWERS = r"(?:is|because|since)"
"""Words after "A" or "I" that make it the choice: neither the article nor the pronoun precedes them."""


# What may wrap the letter after "answer is": emphasis, math (`$B$`, `\(B\)`), text (`\text{B}`), brackets.
_OPENING = r"(?:[*_$(\[]|\\\(|\\(?:text|textbf|mathrm|mathbf)\{)*+"
_CLOSING = r"(?:[*_$)\]}]|\\\))*+"


def chosen(response: str, choices: str) -> str | None:
    response = response.rpartition("</think>")[2]
    letter = f"[{choices}]"
    # The letter after "answer is" or "Answer:", perhaps named as the option ("option B").
    after = rf"[*_]*+\s*+:?\s*+[*_]*+(?:(?i:option|choice)\s++)?{_OPENING}({letter}){_CLOSING}(?![A-Za-z'’])"
    patterns = (
        # In a box, alone or as text: \boxed{B}, \boxed{\text{B}}, \boxed{\textbf{(B)}}.
        rf"\\boxed\{{\s*(?:\\(?:text|textbf|mathrm|mathbf)\{{\s*)?\(?({letter})\)?\s*\}}?\s*\}}",
        # Markdown emphasis may wrap the word, the colon or the letter: "**Answer:** B", "answer is **(C)**".
        # The runs are possessive (`*+`): no match needs a run to leave characters to a later run of the same
        # characters, and backtracking into them made "answer" and 1,500 spaces take 10 s (cubic in the run).
        # After "is" the letter is the choice whatever follows ("the answer is A as shown"); after "Answer:" (or
        # "Answer") "A" or "I" before a lower-case word starts a sentence.
        rf"(?i:answer)[*_]*+\s*+(?i:is){after}"
        rf"|(?i:answer)[*_]*+\s*+:?{after}(?!(?<=[AI])[ \t]+(?!{CHOICE_FOLLOWERS}\b)[a-z])",
        rf"^\s*\(?({letter})[).:]?\s*$",
        rf"\(({letter})\)",
        rf"(?<![A-Za-z'’])({letter})[*_]*[).]?\s*$",
        # "B is correct": after the letters above, as "Statement I is correct, so (B)" names a statement first.
        rf"(?<![A-Za-z'’])({letter})[ \t]+is[ \t]+(?:the[ \t]+)?(?:correct|right)\b",
        rf"^\s*[*_]*\(?({letter})[).:][*_]*\s",  # the option and its text: "B) 42"
    )
    for pattern in patterns:
        found = re.findall(pattern, response)
        if found:
            last = found[-1]
            return last if isinstance(last, str) else next(group for group in last if group)
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
    timeout_score=0.0,
)
