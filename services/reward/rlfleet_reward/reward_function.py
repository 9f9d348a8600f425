"""The shape of a reward function: what it reads, what it returns, and how it is declared.

A reward function is a plain callable `fn(sample, params) -> float | Scored`, wrapped in a
`RewardFunction` that declares the item fields it reads, a description and (optionally) a pydantic
model of its parameters. The hub validates `params` against that model before any item is scored
and passes the validated values (defaults filled in) as a plain mapping.

A plain function computes: it runs in a worker process, where a time limit can kill it. An `async def`
function waits on the network (a reward model, an LLM judge): it runs on the hub's event loop,
many at once, cancelled at its time limit, and must not block. Work after the wait that could run long
on what came back (the judge's caller-given regex over a model's text) goes in `finish`, a plain
function that runs in a worker like any other: cancelling a coroutine cannot stop a regex, which holds
the event loop, and with it every request and /health, until it is done.

An item that runs out of time (past the item's limit, or a limit of the function's own: it raises
`TimeLimitExceeded`) is a TIMEOUT, which training drops, unless the function declares a `timeout_score`: then
the term scores that, with a `timed_out` part of 1. A verifier declares one (0): a response it cannot check in
time is almost surely wrong, and one dropped from the batch would teach the policy that such responses escape
a low reward. A function that waits on something other than the response (a reward model over the network)
declares none: its timeouts say nothing about the response.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

INPUT_FIELDS = ("prompt", "response", "label", "metadata")


@dataclass(frozen=True)
class RewardInput:
    """One item as a reward function sees it. Fields the function did not declare arrive empty."""

    prompt: str = ""
    response: str = ""
    label: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Scored:
    """A score plus named sub-scores, reported as components `<function>/<part>`."""

    score: float
    parts: Mapping[str, float] = field(default_factory=dict)


class ScoreFn(Protocol):
    def __call__(self, sample: RewardInput, params: Mapping[str, Any]) -> float | Scored: ...


class AsyncScoreFn(Protocol):
    """Returns the score, or, when the function has a `finish`, the RewardInput that `finish` scores."""

    def __call__(self, sample: RewardInput, params: Mapping[str, Any]) -> Awaitable[float | Scored | RewardInput]: ...


@dataclass(frozen=True)
class RewardFunction:
    """A scoring callable with its declaration; an entry point in `rlfleet.reward_functions` names one.

    `fn` must be a module-level function: it runs in worker processes, which import it by name
    (or, for an `async def`, on the hub's event loop). `finish`, only beside an `async def` fn, is
    a module-level plain function that scores what `fn` returned, a `RewardInput` (the judge's:
    the model's text as `response`), in a worker, within what is left of the item's time limit.
    `timeout_score`: what the term scores on an item that runs out of time (with a `timed_out` part of 1);
    None keeps such an item a TIMEOUT.
    """

    fn: ScoreFn | AsyncScoreFn
    inputs: frozenset[str]
    description: str
    params: type[BaseModel] | None = None
    finish: ScoreFn | None = None
    timeout_score: float | None = None

    def __post_init__(self) -> None:
        unknown = set(self.inputs) - set(INPUT_FIELDS)
        if unknown:
            raise ValueError(f"inputs {sorted(unknown)} are not item fields; choose from {list(INPUT_FIELDS)}")
        if not self.inputs:
            raise ValueError(f"declare at least one input from {list(INPUT_FIELDS)}")
        if not self.description.strip():
            raise ValueError("a reward function needs a one-line description")
        if self.finish is not None and not (self.waits_on_io and not inspect.iscoroutinefunction(self.finish)):
            raise ValueError("finish is a plain function that follows an async def fn; a plain fn scores by itself")
        if self.timeout_score is not None and not math.isfinite(self.timeout_score):
            raise ValueError(f"timeout_score must be a finite number or None, got {self.timeout_score}")
        object.__setattr__(self, "inputs", frozenset(self.inputs))

    @property
    def waits_on_io(self) -> bool:
        """True for an `async def` function, which runs on the event loop instead of in a worker."""
        return inspect.iscoroutinefunction(self.fn)
