"""`boxed`: the response's last `\\boxed{...}` answer compared with the label, after light LaTeX normalization.

Braces are matched, so `\\boxed{\\frac{1}{2}}` yields `\\frac{1}{2}`. The label may be boxed itself or
plain. Normalization drops `$` and `\\$`, spacing commands (`\\!`, `\\,`, `\\;`, `\\ `; not the row break `\\\\`),
`\\left`/`\\right` (not `\\leftarrow`), `^\\circ`, `%` and `\\%`, a unit in `\\text{...}` or `\\mathrm{...}` after a
number (`12\\text{ dollars}`, `5\\,\\mathrm{cm}^2`), one variable naming the answer (`x = 5`: a letter, then the
answer's only `=`), the `\\text{...}` wrappers left, thousands separators in an answer that is one number (`1,000`,
`1{,}000`: a comma between digits and followed by exactly three, so the lists `1,2` and `2, 345` and the point
`(2,100)` keep theirs), whitespace and a trailing period; it reads `\\dfrac`/`\\tfrac` as `\\frac`, `\\frac12` as
`\\frac{1}{2}`, `\\sqrt2` as `\\sqrt{2}`, the Unicode minus as `-` and `.5` as `0.5`. Two answers that are each one
number (an integer or decimal, `a/b`, or `\\frac{a}{b}`, signed) are equal when their values are exactly
(`0.5`, `1/2` and `\\frac{2}{4}`; not `0.333` and `\\frac13`); other answers when their strings are. It is not
symbolic equivalence (that is the `math` function).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
# `\left(`, not the `\left` of `\leftarrow`; a percent sign, as verl's normalization drops it. A row break `\\`
# is matched first and kept (group 1), so that its second backslash and a space do not read as the space `\ `.
_DROPPED = re.compile(r"(\\\\)|\\[!,;: $]|\\(?:left|right)(?![A-Za-z])|\^\{?\\circ\}?|\$|\\?%")
# A unit after a number (or a fraction's brace) that ends the answer: `12\text{ dollars}`, `5\,\mathrm{cm}^2`.
_UNIT = re.compile(
    r"(?<=[\d}])(?:\s|~|\\[,;: !])*\\(?:text|textrm|mathrm|mbox)\{\s*[A-Za-z][A-Za-z/. ]*\}(?:\^\{?\d\}?)?\s*$"
)
# `x = 5`, `k_1 = 5`: the name of what the answer is, when the answer has no other `=`.
_NAMED = re.compile(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*=")
_SQRT = re.compile(r"\\sqrt([0-9A-Za-z])")  # `\sqrt2` as `\sqrt{2}`, after spaces are dropped (`\sqrt 2`)
_DECIMAL = r"-?\d+(?:\.\d+)?"
_ONE_NUMBER = re.compile(rf"({_DECIMAL})(?:/({_DECIMAL}))?|(-?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}")
# Only in an answer that is one number, so that the point `(2,100)` does not read as (2100); checked before
# whitespace is dropped, so that the list `2, 345` does not read as 2345.
_GROUPED_NUMBER = re.compile(r"[-+]?\d{1,3}(?:(?:,|\{,\})\d{3})+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\})(?=\d{3}(?!\d))")
# `\frac12` and `\frac1{2}` as `\frac{1}{2}`: LaTeX reads one character as an argument.
_FRAC = re.compile(r"\\frac(\{[^{}]*\}|[0-9A-Za-z])(\{[^{}]*\}|[0-9A-Za-z])")
_BARE_DECIMAL = re.compile(r"(?<![\w}])\.(?=\d)")  # `.5` as `0.5`
_SPACE = re.compile(r"\s+")
_BRACE = re.compile(r"[{}]")
_TOKEN = re.compile(r"[^\s$]+")  # `\boxed 7`: up to a space or the closing `$`
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\boxed x`), braces matched; None without one."""
    closing = _closing_braces(text)
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if not text.startswith("{", start):
            token = _TOKEN.match(text, start)
            if token:
                return token.group()
            continue
        if start in closing:
            return text[start + 1 : closing[start]]
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each `{` -> position of the `}` that closes it, in one pass: a response that repeats
    `\\boxed{` thousands of times without closing it must not cost a scan per box."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for brace in _BRACE.finditer(text):
        if brace.group() == "{":
            opened.append(brace.start())
        elif opened:
            closing[opened.pop()] = brace.start()
    return closing


def normalize(answer: str) -> str:
    answer = _UNIT.sub("", answer)
    if answer.count("=") == 1 and (named := _NAMED.match(answer)):
        answer = answer[named.end() :]
    answer = _DROPPED.sub(r"\1", _TEXT.sub(r"\1", answer)).replace("\u2212", "-")
    if _GROUPED_NUMBER.fullmatch(answer.strip()):
        answer = _THOUSANDS.sub("", answer)
    answer = _SPACE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    answer = _FRAC.sub(lambda m: "\\frac" + "".join(_braced(arg) for arg in m.groups()), answer)
    answer = _SQRT.sub(r"\\sqrt{\1}", answer)
    return _BARE_DECIMAL.sub("0.", answer).rstrip(".")


def _value(answer: str) -> Fraction | None:
    """The exact value of a normalized answer that is one number (`-0.5`, `1/2`, `\\frac{1}{2}`); else None."""
    match = _ONE_NUMBER.fullmatch(answer)
    if match is None:
        return None
    number, over, sign, numerator, denominator = match.groups()
    try:
        if number is not None:
            return Fraction(number) / Fraction(over) if over else Fraction(number)
        quotient = Fraction(numerator) / Fraction(denominator)
    except (ValueError, ZeroDivisionError):  # a zero denominator; digits past int()'s limit: compared as text
        return None
    return -quotient if sign else quotient


def _same_answer(normalized: str, gold: str) -> bool:
    if normalized == gold:
        return True
    number = _value(normalized)
    return number is not None and number == _value(gold)


def _braced(argument: str) -> str:
    return argument if argument.startswith("{") else "{" + argument + "}"


def score_boxed(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    gold = last_boxed(sample.label)
    gold = normalize(sample.label if gold is None else gold)
    if not gold:
        raise ValueError(f"the label {sample.label[:60]!r} has no answer")
    answer = last_boxed(sample.response)
    correct = answer is not None and _same_answer(normalize(answer), gold)
    return Scored(score=float(correct), parts={"found": float(answer is not None)})


BOXED = RewardFunction(
    fn=score_boxed,
    inputs=frozenset({"response", "label"}),
    description="1.0 if the response's last \\boxed{} answer equals the label after LaTeX normalization",
    timeout_score=0.0,
)
