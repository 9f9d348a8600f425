from __future__ import annotations

import time

import pytest

from rlfleet_reward.arith_exact import ARITH_EXACT, score_arith_exact
from rlfleet_reward.code_execution import extract_program
from rlfleet_reward.math_answer import MATH, MathParams, score_math
from rlfleet_reward.reward_function import RewardInput
from rlfleet_reward.time_limit import TimeLimitExceeded

MATH_DEFAULTS = MathParams().model_dump()


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("82", "82", 1.0),
        ("82\n1+1=2", "82", 1.0),  # only the first line is the answer
        ("  82 \n", "82", 1.0),
        ("082", "82", 1.0),  # compared as integers
        ("+82", "82", 1.0),
        ("-0", "0", 1.0),
        ("-7", "-7", 1.0),
        ("81", "82", 0.0),
        ("-82", "82", 0.0),
        ("", "82", 0.0),
        ("82 apples", "82", 0.0),
        ("8 2", "82", 0.0),
        ("82.0", "82", 0.0),
        ("\n82", "82", 0.0),  # the first line is empty
    ],
)
def test_arith_exact(response: str, label: str, expected: float) -> None:
    assert score_arith_exact(RewardInput(response=response, label=label), {}) == expected


def test_arith_exact_handles_integers_beyond_int_conversion_limit() -> None:
    digits = "9" * 10_000
    assert score_arith_exact(RewardInput(response=digits, label=digits), {}) == 1.0
    assert score_arith_exact(RewardInput(response=digits + "8", label=digits), {}) == 0.0


def test_arith_exact_rejects_a_label_that_is_not_an_integer() -> None:
    with pytest.raises(ValueError, match="label 'x' is not an integer"):
        score_arith_exact(RewardInput(response="1", label="x"), {})


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("so x = 2 + 2 = $4$", "4", 1.0),
        ("$\\boxed{3}$", "$4$", 0.0),
        ("no idea", "4", 0.0),
        # A label is the answer itself, bare LaTeX included: read whole, not as a text to search.
        ("$2$", "2\\pi", 0.0),
        ("$2\\pi$", "2\\pi", 1.0),
        ("$1$", "[0, 1)", 0.0),
        ("\\boxed{[0, 1)}", "[0, 1)", 1.0),
        ("$x^2 + 2x + 1$", "(x+1)^2", 1.0),
        ("$\\frac{1}{2}$", "\\frac12", 1.0),
        ("$\\frac{1}{2}$", "$\\boxed{\\frac{1}{2}}$", 1.0),
        # ... but a sentence is searched for its answer, as before.
        ("so it is $72$", "The answer is 72", 1.0),
        ("so it is $72$", "She sold 48 clips in May. #### 72", 1.0),
    ],
)
def test_math(response: str, label: str, expected: float) -> None:
    assert score_math(RewardInput(response=response, label=label), MATH_DEFAULTS) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        # An escaped dollar is a dollar sign, not math mode: the label is still the answer itself.
        ("The cost is $\\boxed{1.17}$.", "\\$1.17", 1.0),
        ("So $\\boxed{32,348}$ dollars.", "\\$32,\\!348", 1.0),
        ("$\\boxed{1.18}$", "\\$1.17", 0.0),
        # Words inside \text{} are the answer, not a sentence to search.
        ("$\\boxed{\\text{no solution}}$", "\\text{no solution}", 1.0),
        ("$\\boxed{5}$", "\\text{no solution}", 0.0),
        # A bare word is compared as a word: read as a product of letters, any anagram of it matched.
        ("So the winner is \\boxed{May}.", "Amy", 0.0),
        ("\\boxed{ABC}", "ACB", 0.0),
        ("\\boxed{on}", "no", 0.0),
        ("So the winner is \\boxed{Amy}.", "Amy", 1.0),
        ("\\boxed{\\text{No}}", "no", 1.0),
        # A number with its unit: the number alone matches (its unit's letters were multiplied in).
        ("He pays \\boxed{12}.", "12 dollars", 1.0),
        ("He pays \\boxed{13}.", "12 dollars", 0.0),
        ("The area is \\boxed{4}", "4 cm^2", 1.0),
        ("\\boxed{5 \\text{ km/h}}", "5 km/h", 1.0),
    ],
)
def test_math_label_with_an_escaped_dollar_or_text_is_the_answer_itself(
    response: str, label: str, expected: float
) -> None:
    assert score_math(RewardInput(response=response, label=label), MATH_DEFAULTS) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("Try \\boxed{3}. Final: \\boxed{4}", "4", 1.0),  # not the set {3, 4}
        ("Try \\boxed{4}. Final: \\boxed{3}", "4", 0.0),
        ("$\\boxed{12.}$", "12", 1.0),
        ("so $\\boxed{\\frac{1}{2}.}$", "0.5", 1.0),
        # A label is read the same way: before, `10.` read as no number and every answer scored 0.
        ("The answer is \\boxed{10}.", "10.", 1.0),
        ("\\boxed{10}", "\\boxed{10.}", 1.0),
        ("\\boxed{-7}", "-7.", 1.0),
        ("\\boxed{3.5}", "3.5.", 1.0),
        ("\\boxed{3}", "3.5.", 0.0),
        ("\\boxed{4}", "Try \\boxed{3}, then \\boxed{4}.", 1.0),
    ],
)
def test_math_reads_the_last_box_as_the_answer_without_a_closing_period(
    response: str, label: str, expected: float
) -> None:
    assert score_math(RewardInput(response=response, label=label), MATH_DEFAULTS) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        # Forms math-verify reads as something else or as nothing: the Unicode minus of typeset text (nothing),
        # a thin space between digit groups (1 times 000), a degree sign or `\\degree` (nothing), `\\varnothing`
        # (a symbol), and `1.5e3` (1.5 times e times 3).
        ("The answer is \u22127.", "-7", 1.0),
        ("The answer is \u22127.", "7", 0.0),
        ("\\boxed{\u22125}", "\u22125", 1.0),
        ("\\boxed{1\\,000}", "1000", 1.0),
        ("\\boxed{1\\,000\\,000}", "1000000", 1.0),
        ("\\boxed{1000}", "1\\,000", 1.0),
        ("\\boxed{1\\,000}", "1", 0.0),
        ("\\boxed{90\u00b0}", "90", 1.0),
        ("\\boxed{90\\degree}", "90^\\circ", 1.0),
        ("\\boxed{45\u00b0}", "90", 0.0),
        ("\\boxed{\\varnothing}", "\\emptyset", 1.0),
        ("\\boxed{\\varnothing}", "\\{0\\}", 0.0),
        ("\\boxed{1.5e3}", "1500", 1.0),
        ("\\boxed{1e-3}", "0.001", 1.0),
        ("\\boxed{1.5e3}", "15", 0.0),
        # A percent equals its number and its value: math-verify held that for whole numbers (`50\\%` = 50 = 0.5)
        # but read `12.5\\%` as 0.125 only.
        ("\\boxed{12.5\\%}", "12.5", 1.0),
        ("\\boxed{12.5}", "12.5\\%", 1.0),
        ("\\boxed{0.125}", "12.5\\%", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{12.5\\%}", "12.6", 0.0),
        ("\\boxed{13.5\\%}", "12.5\\%", 0.0),
    ],
)
def test_math_reads_forms_math_verify_misreads(response: str, label: str, expected: float) -> None:
    assert score_math(RewardInput(response=response, label=label), MATH_DEFAULTS) == expected


def test_math_rejects_a_label_without_an_answer() -> None:
    with pytest.raises(ValueError, match="no answer in the label"):
        score_math(RewardInput(response="4", label=""), MATH_DEFAULTS)


def test_math_bounds_the_whole_item_with_its_own_limit() -> None:
    # Thousands of fractions take math-verify's parser seconds, each parse once under a 5 s limit of its own.
    fractions = "\\boxed{" + "+".join(f"\\frac{{{i}}}{{{i + 1}}}" for i in range(1, 4000)) + "}"
    params = {**MATH_DEFAULTS, "timeout_seconds": 0.3}
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match="math-verify ran past its 0.3 s limit"):
        score_math(RewardInput(response=fractions, label="7\\%"), params)
    assert time.monotonic() - started < 1.5
    with pytest.raises(ValueError, match="could not read the label"):
        score_math(RewardInput(response="7", label=fractions), params)
    assert score_math(RewardInput(response="\\boxed{7}", label="7\\%"), params) == 1.0  # and the next item scores


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("Run it:\n```bash\npython main.py\n```\nSolution:\n```python\nprint(2)\n```", "print(2)\n"),
        ("```py title=main.py\nprint(3)\n```\n```text\n3\n```", "print(3)\n"),
        ("```\nprint(4)\n```", "print(4)\n"),
        ("print(5)", "print(5)"),
        ("```python\nprint(6)\n```\nIt prints:\n```\n6\n```", "print(6)\n"),  # an untagged output block
        ("```python\nprint(7)\n```\n```\n$ python main.py\n7\n```", "print(7)\n"),
        ("```\nprint(8)\n```\n```text\n8\n```", "print(8)\n"),
    ],
)
def test_the_program_is_the_last_python_block_whatever_blocks_come_before(response: str, program: str) -> None:
    """Before, a fence with another language was not one: a bash block's closing fence opened the next block,
    and the prose between the blocks (`Solution:`) was run as the program."""
    assert extract_program(response) == program


def test_builtins_declare_what_they_read() -> None:
    assert ARITH_EXACT.inputs == {"response", "label"}
    assert MATH.inputs == {"response", "label"}
    assert MATH.params is MathParams
