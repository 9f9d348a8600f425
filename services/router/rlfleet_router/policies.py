"""Routing policies: which healthy worker serves a request, chosen by name.

A policy is any object with `select(workers, request) -> Choice` and `forget(worker)` (the `Policy`
protocol). The built-in ones are cache_aware, least_load, power_of_two and round_robin; another
installed package adds one by declaring an entry point in the group `rlfleet.router.policies` whose
target takes a `PolicyOptions` and returns a policy. Names are resolved when the router starts, so
a typo fails at once with the list of known names.

Load is what the router has in flight at a worker: requests first, then their tokens (prompt plus
the completion budget) to break ties, so a worker running a few long generations counts as busier
than one running as many short ones.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import entry_points
from typing import Protocol

from rlfleet_router.radix_tree import Key, RadixTree
from rlfleet_router.workers import Worker

ENTRY_POINT_GROUP = "rlfleet.router.policies"
# SGLang's default completion budget, counted when a request does not set max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
# Characters per token when only text is known (a common estimate for English with BPE tokenizers).
CHARS_PER_TOKEN = 4


def _first(value: object) -> object:
    """The first prompt of a batch (a list of texts, or a list of token-id lists), else the value itself."""
    if isinstance(value, list) and value and isinstance(value[0], (list, str)):
        return value[0]
    return value


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at: the route and the parsed JSON body (text, input_ids, ...)."""

    route: str
    body: Mapping[str, object] = field(default_factory=dict)

    @cached_property
    def prompt_key(self) -> Key | None:
        """The prompt as token ids (a tuple) or, without ids, as text; of a batch, its first prompt."""
        ids = _first(self.body.get("input_ids"))
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return tuple(ids)
        text = _first(self.body.get("text"))
        if isinstance(text, str) and text:
            return text
        return None

    @cached_property
    def tokens(self) -> int:
        """Estimated tokens the request occupies at the engine: (prompt + completion budget) x samples x prompts."""
        key = self.prompt_key
        prompt = 0 if key is None else len(key) if not isinstance(key, str) else len(key) // CHARS_PER_TOKEN + 1
        params = self.body.get("sampling_params")
        params = _first(params) if isinstance(params, list) else params
        budget, samples = DEFAULT_MAX_NEW_TOKENS, 1
        if isinstance(params, Mapping):
            budget = params.get("max_new_tokens", budget)
            samples = params.get("n", samples)
        prompts = self.body.get("input_ids") or self.body.get("text")
        batch = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (list, str)) else 1
        budget = budget if isinstance(budget, int) and budget >= 0 else DEFAULT_MAX_NEW_TOKENS
        samples = samples if isinstance(samples, int) and samples >= 1 else 1
        return (prompt + budget) * samples * batch


@dataclass(frozen=True)
class Choice:
    worker: Worker
    reason: str
    """Why this worker, for the routing-decisions metric: cache_hit, imbalance, low_match, least_load, ..."""


@dataclass(frozen=True)
class PolicyOptions:
    """Settings of the built-in policies (each reads the ones it needs)."""

    cache_threshold: float = 0.3
    """cache_aware: smallest fraction of the prompt an engine must hold for the request to follow the cache."""
    cache_tokens_per_request: int = 24
    """cache_aware: prompt tokens whose prefill costs an engine as much as one more request in flight; the
    exchange rate between cache misses and load in an engine's cost (see `CacheAware`)."""
    balance_abs_threshold: int = 2
    """cache_aware: an engine is overloaded, and takes no request, when it has more requests in flight than
    this many ..."""
    balance_rel_threshold: float = 1.25
    """... plus this factor times the fleet's mean requests in flight per engine."""
    max_tree_tokens: int = 2**24
    """cache_aware: global budget of the prefix tree, in tokens (characters for text prompts), all engines together."""
    seed: int | None = None
    """power_of_two: seed of its random draws (None: not reproducible)."""


class Policy(Protocol):
    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        """Picks one of `workers` (never empty, all healthy) for `request`."""
        ...

    def forget(self, worker: Worker) -> None:
        """`worker` left the fleet: drop whatever the policy remembers about it."""
        ...


def load(worker: Worker) -> tuple[int, int]:
    return worker.in_flight, worker.in_flight_tokens


class RoundRobin:
    """Cycles through the workers in registry order."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self._counter = itertools.count()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        assert workers, "select() needs at least one worker"
        return Choice(workers[next(self._counter) % len(workers)], "round_robin")

    def forget(self, worker: Worker) -> None:
        pass


class LeastLoad:
    """Lowest load; exact ties rotate so an idle fleet still spreads its first requests."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self._counter = itertools.count()

    def least_loaded(self, workers: Sequence[Worker]) -> Worker:
        assert workers, "select() needs at least one worker"
        lowest = min(load(w) for w in workers)
        tied = [w for w in workers if load(w) == lowest]
        return tied[next(self._counter) % len(tied)]

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        return Choice(self.least_loaded(workers), "least_load")

    def forget(self, worker: Worker) -> None:
        pass


class PowerOfTwo:
    """The less loaded of two workers drawn at random: near least-load balance without a global scan."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self._random = random.Random(options.seed if options else None)

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        assert workers, "select() needs at least one worker"
        if len(workers) == 1:
            return Choice(workers[0], "power_of_two")
        first, second = self._random.sample(list(workers), 2)
        return Choice(first if load(first) <= load(second) else second, "power_of_two")

    def forget(self, worker: Worker) -> None:
        pass


class CacheAware:
    """Follows the engines' prefix caches as far as that pays for itself in load.

    The tree records, for every prompt routed, the engine it went to. For a new request each engine
    costs its requests in flight plus the prompt tokens it would have to prefill (the part of the
    prompt the tree says it does not hold), converted at `cache_tokens_per_request` tokens to one
    request; the cheapest engine wins, ties to the longer match, then to fewer tokens in flight.
      * No engine holding `cache_threshold` of the prompt: the least-loaded engine (low_match).
      * An engine holding the whole prompt (the samples of one GRPO prompt, sent one after another)
        keeps it while it has room, i.e. is not overloaded: the group's question is prefilled once.
      * An overloaded engine (more requests in flight than `balance_abs_threshold` plus
        `balance_rel_threshold` times the mean over the engines) takes nothing.
    The reason is cache_hit when the chosen engine holds the longest prefix any engine holds, else
    imbalance (load outweighed the cache).

    A popular prompt family spills to a second engine only once its engine is loaded by more than
    its prefix is worth, instead of whenever it queues a little; a shared system prompt worth a few
    requests does not pull every first turn of a conversation onto the engines holding it.
    """

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options or PolicyOptions()
        self.tree = RadixTree(self.options.max_tree_tokens)
        self._least_load = LeastLoad()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        assert workers, "select() needs at least one worker"
        key = request.prompt_key
        if key is None:
            return Choice(self._least_load.least_loaded(workers), "no_prompt")
        choice = self._choose(workers, key)
        self.tree.insert(key, choice.worker.id)
        return choice

    def forget(self, worker: Worker) -> None:
        self.tree.remove_tenant(worker.id)

    def _choose(self, workers: Sequence[Worker], key: Key) -> Choice:
        matched = self.tree.match(key).matched
        held = {w.id: matched.get(w.id, 0) for w in workers}
        longest = max(held.values())
        size = len(key)
        if longest == 0 or longest < self.options.cache_threshold * size:
            return Choice(self._least_load.least_loaded(workers), "low_match")
        opts = self.options
        # Against the mean rather than the least-loaded engine: one idle engine must not make every
        # other one overloaded, and a fleet with more engines than prompt families still fills them all.
        cap = opts.balance_abs_threshold + opts.balance_rel_threshold * sum(w.in_flight for w in workers) / len(workers)
        room = [w for w in workers if w.in_flight <= cap]
        whole = [w for w in room if held[w.id] == size]
        if whole:
            best = min(whole, key=load)
            return Choice(best, "cache_hit")
        # Text prompts are matched by character; their cost is in estimated tokens like an id prompt's.
        per_request = opts.cache_tokens_per_request * (CHARS_PER_TOKEN if isinstance(key, str) else 1)

        def cost(w: Worker) -> tuple[float, int, int]:
            return w.in_flight + (size - held[w.id]) / per_request, -held[w.id], w.in_flight_tokens

        best = min(room, key=cost)
        return Choice(best, "cache_hit" if held[best.id] == longest else "imbalance")


BUILTIN_POLICIES: Mapping[str, Callable[[PolicyOptions], Policy]] = {
    "cache_aware": CacheAware,
    "least_load": LeastLoad,
    "power_of_two": PowerOfTwo,
    "round_robin": RoundRobin,
}


def available_policies() -> dict[str, Callable[[PolicyOptions], Policy]]:
    """Built-in policies plus those other packages declare as entry points."""
    found: dict[str, Callable[[PolicyOptions], Policy]] = dict(BUILTIN_POLICIES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    return found


def create_policy(name: str, options: PolicyOptions | None = None) -> Policy:
    """The policy called `name`; ValueError listing the known names otherwise."""
    policies = available_policies()
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; known policies: {', '.join(sorted(policies))}")
    return policies[name](options or PolicyOptions())
