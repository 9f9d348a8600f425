"""`math`: symbolic answer checking with the math-verify library (parse label and response, verify).

The label is the reference answer itself. math-verify reads a text by searching it for its answer, which
misreads a bare expression: `2\\pi` reads as 2, `[0, 1)` as 1, and `(x+1)^2` or `\\frac12` as nothing.
So a label without `$`, `\\(`, `\\[` or `\\boxed` is read as `\\boxed{label}`, whole (as verl does), less a
period closing it (`10.`: the sentence's, not the number's); a single word as `\\boxed{\\text{word}}` (boxed bare,
its letters are multiplied, and `May` matched `Amy`), and a number with a unit (`12 dollars`, `4 cm^2`) with the
unit as text, so that the number alone matches. One that has them, or is a sentence, is read the way a response
is. An escaped `\\$` is a dollar sign, not math mode (`\\$1.17`), and words inside
`\\text{...}` are not a sentence (`\\text{no solution}`).

A response's answer is its last `\\boxed{...}`, as for `boxed`: math-verify would read every box in it as
one set, so a response that tries 3 and then settles on 4 would match neither. A period closing the box
(`\\boxed{12.}`) is dropped, as math-verify reads `12.` as no number. A response without a box is searched
whole.

Both texts are first rewritten where math-verify misreads a common form: the Unicode minus `−` as `-` (it read
no number), a thin space between digit groups (`1\\,000`, read as 1 times 000) dropped, `°` and `\\degree` as
`^\\circ` (no answer), `\\varnothing` as `\\emptyset` (a symbol), and a number in E notation (`1.5e3`, read as
1.5 times e times 3) as `1.5\\times10^{3}`. A percent equals its number and its value (`12.5\\%` matches 12.5
and 0.125): math-verify does so for whole numbers only, so answers that fail with a percent sign in either are
compared again without it.

Time: math-verify bounds each parse and each comparison with a `signal.alarm` of its own, 5 s apiece, and one
item makes several (the label, the response, a comparison per pair of their readings, then again without a
percent sign): together they passed the hub's default 10 s limit, and the item ended a TIMEOUT, which training drops.
Those limits are off here; one limit, `timeout_seconds` (5 s), bounds the whole item instead (an ITIMER_REAL
alarm, which works only in a process's main thread: the hub calls reward functions in the main thread of its
worker processes). A response math-verify cannot read and compare within it (thousands of `\\frac`, a tower of
exponents) scores 0 with `math/timed_out` 1 (`TimeLimitExceeded`, and `MATH.timeout_score`), in the worker,
which goes on serving; one stuck in C code that no alarm interrupts runs to the item's limit, where the hub
kills the worker and scores it the same. A label that cannot be read within the limit is the dataset's fault,
not the response's: the item is an ERROR.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from math_verify import parse, verify
from pydantic import BaseModel, ConfigDict, Field

from rlfleet_reward.boxed_answer import last_boxed
from rlfleet_reward.reward_function import RewardFunction, RewardInput
from rlfleet_reward.time_limit import TimeLimitExceeded, time_limit


class MathParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    float_rounding: int = Field(default=6, ge=0, le=30, description="Decimal places floats are rounded to.")
    numeric_precision: int = Field(default=15, ge=1, le=100, description="Significant digits of numeric comparisons.")
    strict: bool = Field(default=True, description="Variables must match by name, sets never equal tuples.")
    timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="Longest math-verify may take on one item, reading both answers and comparing them; past it "
        "the response scores 0 (`math/timed_out`). Keep it below the spec's time limit.",
    )


class _OwnLimitNotice(logging.Filter):
    """Drops math-verify's warning that its own time limits are off: `score_math` bounds the work itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_OwnLimitNotice())


_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")
# Two words in a row, neither a LaTeX command: a sentence ("The answer is 72", a worked GSM8K solution ending
# in "#### 72"), whose answer is searched for, as in a response; boxed whole it would read as a product of
# letters and match nothing. Words in `\text{...}` are part of the answer, so they are left out of the test.
_SENTENCE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}\s+[A-Za-z]{2,}")
_TEXT = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox)\{[^{}]*\}")
# A period ending a bare label (`10.`, `3.5.`), not the dots of `1, 2, \\ldots` written `...`.
_CLOSING_PERIOD = re.compile(r"(?<=[^.\s])\.\s*$")


# A bare label of one word ("Amy", "no", the vertices "ACB"): boxed, math-verify reads it as a product of letters,
# so any anagram matched it ("May", "on", "ABC"); as `\text{...}` it is compared as the word it is.
_WORD = re.compile(r"[A-Za-z]{2,}")
# A number and its unit ("12 dollars", "4 cm^2", "5 km/h"): boxed whole, the unit's letters were multiplied in and
# the number alone matched nothing; with the unit in `\text{...}` math-verify compares the number.
_WITH_UNIT = re.compile(r"([-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?)\s+([A-Za-z]{2,}[A-Za-z0-9^/ ]*)")


# Forms math-verify misreads, as forms it reads: see the module docstring.
_MISREAD = re.compile(r"\u2212|(?<=\d)\\,(?=\d{3}(?!\d))|\u00b0|\\degree(?![A-Za-z])|\\varnothing(?![A-Za-z])")
_READ_AS = {"\u2212": "-", "\\,": "", "\u00b0": "^\\circ", "\\degree": "^\\circ", "\\varnothing": "\\emptyset"}
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_PERCENT = re.compile(r"\\?%")


def _readable(text: str) -> str:
    text = _MISREAD.sub(lambda match: _READ_AS[match.group()], text)
    return _E_NOTATION.sub(r"\1\\times10^{\2}", text)


def _gold_text(label: str) -> str:
    label = _readable(label)
    if _DELIMITED.search(label) or _SENTENCE.search(_TEXT.sub(" ", label)):
        return _answer_text(label)
    bare = _CLOSING_PERIOD.sub("", label.strip())
    if _WORD.fullmatch(bare):
        return f"\\boxed{{\\text{{{bare}}}}}"
    if unit := _WITH_UNIT.fullmatch(bare):
        return f"\\boxed{{{unit[1]} \\text{{ {unit[2]}}}}}"
    return f"\\boxed{{{bare}}}"


def _answer_text(text: str) -> str:
    """The text's last box alone, without a closing period, or the whole text when it has none."""
    boxed = last_boxed(text)
    return text if boxed is None else f"\\boxed{{{boxed.strip().removesuffix('.')}}}"


def score_math(sample: RewardInput, params: Mapping[str, Any]) -> float:
    """1.0 or 0.0; raises TimeLimitExceeded past `timeout_seconds`, ValueError for a label without an answer."""
    gold_text, answer_text = _gold_text(sample.label), _answer_text(_readable(sample.response))
    limit = params["timeout_seconds"]
    reading_label = True
    try:
        with time_limit(limit, "math-verify"):
            gold = _parse(gold_text)
            reading_label = False
            if not gold:
                raise ValueError(f"math-verify found no answer in the label {sample.label[:60]!r}")
            correct = _equivalent(gold, answer_text, params)
            if not correct and (_PERCENT.search(gold_text) or _PERCENT.search(answer_text)):
                correct = _equivalent(_parse(_PERCENT.sub("", gold_text)), _PERCENT.sub("", answer_text), params)
    except TimeLimitExceeded:
        if reading_label:
            raise ValueError(
                f"math-verify could not read the label {sample.label[:60]!r} within timeout_seconds ({limit:g} s)"
            ) from None
        raise
    return 1.0 if correct else 0.0


def _parse(text: str) -> list[Any]:
    return parse(text, parsing_timeout=None)  # bounded by score_math's own limit


def _equivalent(gold: list[Any], answer_text: str, params: Mapping[str, Any]) -> bool:
    return verify(
        gold,
        _parse(answer_text),
        float_rounding=params["float_rounding"],
        numeric_precision=params["numeric_precision"],
        strict=params["strict"],
        timeout_seconds=None,
    )


MATH = RewardFunction(
    fn=score_math,
    inputs=frozenset({"response", "label"}),
    description="1.0 if math-verify finds the response's answer equivalent to the label's; else 0.0",
    params=MathParams,
    timeout_score=0.0,
)
