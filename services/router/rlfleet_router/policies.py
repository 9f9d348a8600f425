"""Routing policies: which healthy worker serves a request, chosen by name.

A policy is any object with `select(workers, request) -> Worker` (the `Policy` protocol). The
built-in ones are below; another installed package adds one by declaring an entry point in the
group `rlfleet.router.policies` whose target takes no arguments and returns a policy. Names are
resolved when the router starts, so a typo fails at once with the list of known names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Protocol

from rlfleet_router.workers import Worker

ENTRY_POINT_GROUP = "rlfleet.router.policies"


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at: the route and the parsed JSON body (text, input_ids, ...)."""

    route: str
    body: Mapping[str, object] = field(default_factory=dict)


class Policy(Protocol):
    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        """Picks one of `workers` (never empty, all healthy) for `request`."""
        ...


class RoundRobin:
    """Cycles through the workers in registry order."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        assert workers, "select() needs at least one worker"
        return workers[next(self._counter) % len(workers)]


class LeastLoad:
    """Fewest requests in flight; ties rotate so an idle fleet still spreads its first requests."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        assert workers, "select() needs at least one worker"
        lowest = min(w.in_flight for w in workers)
        tied = [w for w in workers if w.in_flight == lowest]
        return tied[next(self._counter) % len(tied)]


BUILTIN_POLICIES: Mapping[str, Callable[[], Policy]] = {
    "least_load": LeastLoad,
    "round_robin": RoundRobin,
}


def available_policies() -> dict[str, Callable[[], Policy]]:
    """Built-in policies plus those other packages declare as entry points."""
    found: dict[str, Callable[[], Policy]] = dict(BUILTIN_POLICIES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    return found


def create_policy(name: str) -> Policy:
    """The policy called `name`; ValueError listing the known names otherwise."""
    policies = available_policies()
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; known policies: {', '.join(sorted(policies))}")
    return policies[name]()
