"""Argument types that refuse a bad number while the command line is parsed, before any work starts."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An int >= 1 (argparse names the flag in its error: `argument --engines: must be >= 1, got 0`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# Engines of one fleet on one machine: their ports run on from the first engine's (30001 by default), clear of
# the fleet's other default ports and inside what --free-ports draws from.
MAX_ENGINES = 256


def engine_count(text: str) -> int:
    """positive_int, at most MAX_ENGINES (`argument --engines: one machine's fleet runs at most 256 engines`)."""
    value = positive_int(text)
    if value > MAX_ENGINES:
        raise argparse.ArgumentTypeError(f"one machine's fleet runs at most {MAX_ENGINES} engines, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0, e.g. a timeout in seconds (`inf` would overflow the socket timeouts it becomes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def redis_prefix(text: str) -> str:
    """A non-empty Redis key prefix: fleets sharing a Redis tell their keys apart by it, and without one a fleet
    writes its keys among the Redis's others."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty: fleets sharing a Redis tell their keys apart by it")
    return text
