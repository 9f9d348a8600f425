"""Regular expressions a caller's spec gives (`format.pattern`, `judge.verdict_pattern`), checked when the spec is.

A pattern is bounded in length (it is compiled on the hub's event loop while the request is validated, and
compiling takes time in proportion to it) and must compile: a syntax error, and nesting too deep for the
compiler (RecursionError), are the caller's errors, answered 400 naming the field rather than 500.
"""

from __future__ import annotations

import re

MAX_PATTERN_CHARS = 10_000


def compiled(pattern: str) -> re.Pattern[str]:
    """`pattern` compiled; ValueError saying why it cannot be (pydantic reports it against the field)."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    except (RecursionError, OverflowError):
        raise ValueError("not a regular expression this hub compiles: it is nested too deeply") from None
