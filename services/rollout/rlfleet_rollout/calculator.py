"""The `calculator` environment: the model may ask for arithmetic by writing `[EXPR]`, e.g. `[37+45]`,
and the next turn starts with the result, `=82` and a newline (`=error` when EXPR is not arithmetic).

    37+45=[37+45]<eos>=82\n82<eos>
    prompt  model    tool  model  (the tool's tokens have loss mask 0)

A turn without a bracketed expression is the final answer and ends the episode. The syntax uses
characters of the tiny model's vocabulary and is short enough for a character-level model to learn.
EXPR is read by a small parser (integers, + - * /, parentheses, unary minus), never `eval`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from rlfleet_rollout.datasets import Prompt

MAX_EXPRESSION_CHARS = 64  # longer is `=error`: it bounds the parser's depth and the numbers' size
TOOL_CALL = re.compile(r"\[([^\[\]]+)\]")
# A decimal shows this many places, or more for a value under 0.1, as many as show this many significant digits.
DECIMAL_DIGITS = 6
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))")


class CalculatorEnvironment:
    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        call = TOOL_CALL.search(turns[-1])
        if call is None:
            return None
        if len(call.group(1)) > MAX_EXPRESSION_CHARS:
            return "=error\n"
        try:
            value = evaluate(call.group(1))
        except ValueError:
            return "=error\n"
        return f"={format_value(value)}\n"


calculator = CalculatorEnvironment()


def format_value(value: Fraction) -> str:
    """An integer as is, any other value as a decimal, never in exponent notation, rounded to DECIMAL_DIGITS
    places (more for a value under 0.1: as many as show DECIMAL_DIGITS significant digits), trailing zeros
    dropped: 617283.5, 0.333333, 0.000000333333. A point always shows the value is not a whole number."""
    if value.denominator == 1:
        return str(value.numerator)
    places = DECIMAL_DIGITS
    while abs(value) * 10**places < 10 ** (DECIMAL_DIGITS - 1):
        places += 1
    scaled = round(value * 10**places)
    digits = str(abs(scaled)).rjust(places + 1, "0")
    whole, fraction = digits[:-places], digits[-places:].rstrip("0")
    return f"{'-' if scaled < 0 else ''}{whole}.{fraction or '0'}"


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError naming what is wrong with it."""
    tokens = [number or symbol for number, symbol in _TOKEN.findall(expression) if number or symbol.strip()]
    parser = _Parser(tokens)
    value = parser.sum()
    if parser.at < len(tokens):
        raise ValueError(f"unexpected {tokens[parser.at]!r} in {expression!r}")
    return value


class _Parser:
    """Recursive descent: sum := product (('+'|'-') product)*; product := unary (('*'|'/') unary)*;
    unary := '-' unary | atom; atom := integer | '(' sum ')'. Depth is bounded by the expression's length."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.at = 0

    def _peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("the expression ends too early")
        self.at += 1
        return token

    def sum(self) -> Fraction:
        value = self.product()
        while self._peek() in ("+", "-"):
            operator = self._take()
            operand = self.product()
            value = value + operand if operator == "+" else value - operand
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/"):
            if self._take() == "*":
                value *= self.unary()
                continue
            divisor = self.unary()
            if divisor == 0:
                raise ValueError("division by zero")
            value /= divisor
        return value

    def unary(self) -> Fraction:
        if self._peek() == "-":
            self._take()
            return -self.unary()
        return self.atom()

    def atom(self) -> Fraction:
        token = self._take()
        if token.isascii() and token.isdigit():  # str.isdigit takes every script's digits: '١' is not a number here
            return Fraction(int(token))
        if token == "(":
            value = self.sum()
            if self._take() != ")":
                raise ValueError("a '(' is not closed")
            return value
        raise ValueError(f"unexpected {token!r}")
