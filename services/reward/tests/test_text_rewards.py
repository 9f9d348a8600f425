from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rlfleet_reward.boxed_answer import last_boxed, normalize, score_boxed
from rlfleet_reward.exact_match import ExactParams, score_exact
from rlfleet_reward.format_regex import FormatParams, score_format
from rlfleet_reward.multiple_choice import ChoiceParams, score_multiple_choice
from rlfleet_reward.numeric_answer import NumericParams, score_numeric
from rlfleet_reward.reward_function import RewardInput, Scored
from rlfleet_reward.token_f1 import score_f1


def params(model: type[BaseModel], **values: Any) -> Mapping[str, Any]:
    return model.model_validate(values).model_dump()


def scored(value: float | Scored) -> tuple[float, dict[str, float]]:
    return (value.score, dict(value.parts)) if isinstance(value, Scored) else (value, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{ {2} }", " {2} "),
        ("\\boxed 7$", "7"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_last_boxed_matches_braces(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_last_boxed_is_linear_in_a_degenerate_response() -> None:
    # A policy that repeats itself writes thousands of unclosed boxes; each one used to rescan the rest.
    text = "\\boxed{" * 3_000 + "\\boxed{7}"
    started = time.monotonic()
    assert last_boxed(text) == "7"
    assert last_boxed(text[: -len("\\boxed{7}")]) is None
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", (1.0, {"found": 1.0})),
        ("$\\boxed{90^\\circ}$", "$\\boxed{90}$", (1.0, {"found": 1.0})),
        ("\\boxed{\\text{Paris}}", "Paris", (1.0, {"found": 1.0})),
        ("\\boxed{3}", "4", (0.0, {"found": 1.0})),
        ("4", "4", (0.0, {"found": 0.0})),  # no boxed answer, no credit
        # Wrong answers normalization made right: \left and \right were dropped out of \leftarrow and
        # \rightarrow, and the comma of a point was read as a thousands separator.
        ("so \\boxed{x \\leftarrow 0^{+}}", "x \\rightarrow 0^{+}", (0.0, {"found": 1.0})),
        ("The point is \\boxed{(2100)}", "(2,100)", (0.0, {"found": 1.0})),
        ("\\boxed{\\left( 2, 100 \\right)}", "(2,100)", (1.0, {"found": 1.0})),
        # Right answers it made wrong.
        ("\\boxed{\\frac12}", "\\frac{1}{2}", (1.0, {"found": 1.0})),
        ("\\boxed{50}", "50\\%", (1.0, {"found": 1.0})),
        ("\\boxed{\u22125}", "-5", (1.0, {"found": 1.0})),
        ("\\boxed{.5}", "0.5", (1.0, {"found": 1.0})),
    ],
)
def test_boxed(response: str, label: str, expected: tuple[float, dict[str, float]]) -> None:
    assert scored(score_boxed(RewardInput(response=response, label=label), {})) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        # A number is compared by its exact value, whatever its form: `0.5`, `1/2` and `\\frac{1}{2}` are one answer.
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac12", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
        ("\\boxed{5.0}", "5", 1.0),
        ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
        ("\\boxed{\\frac{1}{2}}", "-0.5", 0.0),
        ("\\boxed{" + "1" * 5000 + "}", "1" * 5000, 1.0),  # past int()'s digit limit: compared as text
        # A unit in `\\text{...}` after a number is not part of the answer.
        ("\\boxed{12\\text{ dollars}}", "12", 1.0),
        ("\\boxed{5}", "5 \\text{cm}", 1.0),
        ("\\boxed{5\\,\\mathrm{cm}^2}", "5", 1.0),
        ("\\boxed{6\\text{ cm}}", "5", 0.0),
        ("\\boxed{\\text{Paris}}", "Paris", 1.0),
        # One variable named before the answer: `x = 5` is 5.
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{5}", "k=5", 1.0),
        ("\\boxed{x = 6}", "5", 0.0),
        ("\\boxed{x = 2, y = 3}", "2, 3", 0.0),
        # `\\sqrt2` is `\\sqrt{2}`, as LaTeX reads it; and `\\\\` separates a matrix's rows, it is no space.
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
        ("\\boxed{2\\sqrt 3}", "2\\sqrt{3}", 1.0),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix}12\\end{pmatrix}", 0.0),
    ],
)
def test_boxed_reads_one_answer_in_its_usual_forms(response: str, label: str, expected: float) -> None:
    assert scored(score_boxed(RewardInput(response=response, label=label), {}))[0] == expected


@pytest.mark.parametrize(
    ("answer", "same_as"),
    [
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("1,234,567.5", "1234567.5"),
        ("\\$18", "18"),
        ("\\$32,\\!348", "32348"),
        ("2, 345", "2,345"),  # a list keeps its comma
        ("1,23", "1,23"),
    ],
)
def test_boxed_normalization_drops_thousands_separators_and_dollar_signs(answer: str, same_as: str) -> None:
    assert normalize(answer) == same_as


@pytest.mark.parametrize(
    ("response", "label", "options", "expected"),
    [
        (" Paris\n", "Paris", {}, 1.0),
        ("paris", "Paris", {}, 0.0),
        ("paris", "Paris", {"case_sensitive": False}, 1.0),
        (" Paris", "Paris", {"strip": False}, 0.0),
    ],
)
def test_exact(response: str, label: str, options: dict, expected: float) -> None:
    assert score_exact(RewardInput(response=response, label=label), params(ExactParams, **options)) == expected


@pytest.mark.parametrize(
    ("response", "label", "options", "expected"),
    [
        ("so 2 + 2 = 4", "4", {}, 1.0),
        ("about 3.1415", "3.14159", {"abs_tol": 1e-3}, 1.0),
        ("about 3.1415", "3.14159", {}, 0.0),
        ("The answer is 0", "6.626e-34", {}, 0.0),  # a small label is matched by its digits, not by anything near 0
        ("-5e-7", "3e-7", {}, 0.0),
        ("h = 6.626e-34", "6.626e-34", {}, 1.0),
        ("0.0", "0", {}, 1.0),
        ("0.0000001", "0", {"abs_tol": 1e-6}, 1.0),
        ("total: 1,234,567 apples", "1234567", {}, 1.0),
        ("it is 3/4", "0.75", {}, 1.0),
        ("-2.5e3", "-2500", {"extract": "whole"}, 1.0),
        ("x = -2.5e3", "-2500", {"extract": "whole"}, 0.0),
        ("no number", "1", {}, 0.0),
        ("so x = \u22125", "-5", {}, 1.0),  # a Unicode minus sign
        ("so x = \u22125", "5", {}, 0.0),
        ("\u22122.5", "\u22122.5", {"extract": "whole"}, 1.0),
        # Commas only between groups of three digits: a list or a decimal comma is no number (they read as 123, 1234).
        ("1,2,3", "123", {"extract": "whole"}, 0.0),
        ("12,34", "1234", {"extract": "whole"}, 0.0),
        ("1,234.5", "1234.5", {"extract": "whole"}, 1.0),
        # A minus after a digit is a range's dash or a subtraction, not a sign: 5-10 ends in 10.
        ("it takes 5-10 minutes", "10", {}, 1.0),
        ("it takes 5\u221210 minutes", "-10", {}, 0.0),
        ("so 12-7=5, and the loss is -5", "-5", {}, 1.0),
    ],
)
def test_numeric(response: str, label: str, options: dict, expected: float) -> None:
    value, _ = scored(score_numeric(RewardInput(response=response, label=label), params(NumericParams, **options)))
    assert value == expected


def test_numeric_refuses_a_label_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match="is not a number"):
        score_numeric(RewardInput(response="1", label="one"), params(NumericParams))
    with pytest.raises(ValueError, match="is not a number"):  # a list, which read as 12
        score_numeric(RewardInput(response="12", label="1,2"), params(NumericParams))


def test_f1_overlap_and_several_references() -> None:
    value, parts = scored(score_f1(RewardInput(response="The Eiffel tower, Paris", label="eiffel tower"), {}))
    assert value == pytest.approx(0.8) and parts == {"precision": pytest.approx(2 / 3), "recall": 1.0}
    assert scored(score_f1(RewardInput(response="Paris", label='["London", "paris"]'), {}))[0] == 1.0
    assert scored(score_f1(RewardInput(response="nothing alike", label="Paris"), {}))[0] == 0.0


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("Let me think. A is wrong, so the answer is (C).", "C", 1.0),
        ("Answer: b", "B", 0.0),  # options are upper case
        ("Answer: B", "(B)", 1.0),
        ("$\\boxed{D}$", "D", 1.0),
        ("  B.  ", "B", 1.0),
        ("I pick (A) over (B)... final (B)", "B", 1.0),
        ("A cat sat.", "A", 0.0),  # an article is not a choice
        ("Answer: **B**", "B", 1.0),  # markdown emphasis, as chat models write it
        ("**Answer:** B", "B", 1.0),
        ("So the answer is **(C)**.", "C", 1.0),
        ("__Answer__: D", "D", 1.0),
    ],
)
def test_multiple_choice(response: str, label: str, expected: float) -> None:
    value, _ = scored(score_multiple_choice(RewardInput(response=response, label=label), params(ChoiceParams)))
    assert value == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        # The words "I" and "A" starting a sentence after "Answer:" are not choices.
        ("Answer: I think it is B", "B", (1.0, {"found": 1.0})),
        ("Answer: A careful reading gives C", "C", (1.0, {"found": 1.0})),
        ("Answer: I'm not sure, maybe (D)", "D", (1.0, {"found": 1.0})),
        ("Answer: I think so.", "I", (0.0, {"found": 0.0})),
        # ... but they are after a delimiter, and other letters are before any word.
        ("Answer: A, because the rest are wrong", "A", (1.0, {"found": 1.0})),
        ("Answer: I\nsince it covers every case", "I", (1.0, {"found": 1.0})),
        ("Answer: (A) is right", "A", (1.0, {"found": 1.0})),
        ("Answer: B because the rest are wrong", "B", (1.0, {"found": 1.0})),
        # ... and before a word neither the article nor the pronoun precedes.
        ("Answer: A is correct", "A", (1.0, {"found": 1.0})),
        ("Answer: I because it is the only even one", "I", (1.0, {"found": 1.0})),
        ("Answer: A since the others fail", "A", (1.0, {"found": 1.0})),
        ("Answer: A isolated case shows C", "C", (1.0, {"found": 1.0})),
        # An explicit box wins over a passing "the answer is".
        ("If the answer is A, then x < 0, which fails. So $\\boxed{B}$", "B", (1.0, {"found": 1.0})),
        # After "answer is", A is the choice whatever word follows: it was never read, and a (C) the response
        # ruled out earlier was taken instead.
        ("After checking each option, the answer is A as shown above.", "A", (1.0, {"found": 1.0})),
        ("The answer is A for sure", "A", (1.0, {"found": 1.0})),
        ("Option (C) is tempting, but the answer is A as shown above.", "C", (0.0, {"found": 1.0})),
        # A letter boxed as text.
        ("So the final answer is $\\boxed{\\text{A}}$", "A", (1.0, {"found": 1.0})),
        ("So the final answer is $\\boxed{\\textbf{(B)}}$", "B", (1.0, {"found": 1.0})),
    ],
)
def test_multiple_choice_tells_the_words_a_and_i_from_choices(
    response: str, label: str, expected: tuple[float, dict[str, float]]
) -> None:
    assert scored(score_multiple_choice(RewardInput(response=response, label=label), params(ChoiceParams))) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        # The letter written as math or text, or in brackets, after "answer is" or "Answer:".
        ("The answer is $C$.", "C", (1.0, {"found": 1.0})),
        ("The answer is $\\text{C}$, as computed", "C", (1.0, {"found": 1.0})),
        ("The answer is \\textbf{B}", "B", (1.0, {"found": 1.0})),
        ("Answer: [B]", "B", (1.0, {"found": 1.0})),
        ("The answer is \\(D\\) since x > 0", "D", (1.0, {"found": 1.0})),
        # ... or named as the option.
        ("The answer is option B, since it works", "B", (1.0, {"found": 1.0})),
        ("Answer: Option C because it fits", "C", (1.0, {"found": 1.0})),
        ("Answer: choice (A) since the rest fail", "A", (1.0, {"found": 1.0})),
        # A letter said to be correct.
        ("I think B is correct.", "B", (1.0, {"found": 1.0})),
        ("A is wrong and (D) is the correct one", "D", (1.0, {"found": 1.0})),
        ("Statement I is correct and II is not, so (B)", "B", (1.0, {"found": 1.0})),
        # A response that opens with the option and its text.
        ("B) 42", "B", (1.0, {"found": 1.0})),
        ("**C.** The area doubles", "C", (1.0, {"found": 1.0})),
        ("A bird in the hand", "A", (0.0, {"found": 0.0})),
        # The answer follows the reasoning: a box inside `<think>` is a draft.
        ("<think>Maybe \\boxed{A}?</think> Answer: B", "B", (1.0, {"found": 1.0})),
        ("<think>Maybe (A) or (B)</think>", "A", (0.0, {"found": 0.0})),
        ("The answer is $x = 3$", "C", (0.0, {"found": 0.0})),
    ],
)
def test_multiple_choice_reads_the_letter_in_its_usual_forms(
    response: str, label: str, expected: tuple[float, dict[str, float]]
) -> None:
    assert scored(score_multiple_choice(RewardInput(response=response, label=label), params(ChoiceParams))) == expected


@pytest.mark.parametrize("run", [" ", "\n", "*"])
def test_multiple_choice_is_linear_in_a_long_run_after_answer(run: str) -> None:
    # Adjacent runs of spaces or emphasis in the answer pattern backtracked cubically: 1,500 spaces took 10 s.
    response = "The answer" + run * 1_000 + "is unclear."
    started = time.monotonic()
    found = scored(score_multiple_choice(RewardInput(response=response, label="B"), params(ChoiceParams)))
    assert found == (0.0, {"found": 0.0})
    assert time.monotonic() - started < 1.0


def test_multiple_choice_refuses_a_label_outside_the_choices() -> None:
    with pytest.raises(ValueError, match="not one of the choices ABCD"):
        score_multiple_choice(RewardInput(response="A", label="E"), params(ChoiceParams, choices="ABCD"))


@pytest.mark.parametrize(
    ("response", "options", "expected"),
    [
        ("<think>\nhmm\n</think>\n<answer>4</answer>", {}, 1.0),
        ("<answer>4</answer>", {}, 0.0),
        ("<think>x</think><answer>4</answer> trailing", {}, 0.0),
        ("The answer: 42", {"pattern": r"answer: \d+", "mode": "search"}, 1.0),
    ],
)
def test_format(response: str, options: dict, expected: float) -> None:
    assert score_format(RewardInput(response=response), params(FormatParams, **options)) == expected


def test_format_refuses_a_pattern_that_does_not_compile() -> None:
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        FormatParams(pattern="(unclosed")
    with pytest.raises(ValidationError, match="nested too deeply"):
        FormatParams(pattern="(" * 1000 + "a" + ")" * 1000)
