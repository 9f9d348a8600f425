"""Routing policies: which healthy worker serves a request, chosen by name.

A policy is any object with `select(workers, request) -> Choice`, `forget_caches(workers)` and
`forget(worker)` (the `Policy` protocol). The built-in ones are cache_aware, least_load, power_of_two
and round_robin; another installed package adds one by declaring an entry point in the group
`rlfleet.router.policies` whose target takes a `PolicyOptions` and returns a policy. Names are resolved
when the router starts, so a typo fails at once with the list of known names.

Load is what the router has in flight at a worker: requests first, then their tokens (prompt plus
the completion budget) to break ties, so a worker running a few long generations counts as busier
than one running as many short ones.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import entry_points
from typing import Protocol

from rlfleet_router.chars_per_token import DEFAULT_CHARS_PER_TOKEN
from rlfleet_router.radix_tree import RadixTree, TokenKey, token_key
from rlfleet_router.workers import Worker

ENTRY_POINT_GROUP = "rlfleet.router.policies"
# SGLang's default completion budget, counted when a request does not set max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
# cache_aware: each later routed request scales an engine's count of recent assignments by this, so about
# the last 100 requests make up an engine's recent share of the traffic.
RECENT_DECAY = 0.99
# cache_aware: the group size is estimated over this many recent requests: several groups of the usual
# sizes (8-16 samples), so the estimate does not depend on where in a group the window starts.
GROUP_SIZE_WINDOW = 128
# ... and capped here: a flood of one identical prompt must not let its engine take every request in flight.
MAX_GROUP_SIZE = 16
# cache_aware: an engine's own requests in flight count in the fleet's mean its bound is `balance_rel_threshold` x,
# each raising the bound by rel / engines; by at most this, so that an engine whose requests never end (hung) fills
# up on a small fleet too (with rel >= the engines, its bound would grow as fast as its requests).
MAX_OWN_WEIGHT = 0.625
# cache_aware: an engine's slack over the fleet's mean (`balance_abs_threshold` requests) is at most this many
# groups: with prompts of one request each (a conversation's turns), a slack of 10 would let one engine take
# ten new conversations at once while the others have a few, each staying for all its turns.
MAX_SLACK_GROUPS = 1.25


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
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    """The engines' characters per token, which sizes a text prompt in tokens (see `CharsPerToken`)."""
    excluded: frozenset[str] = frozenset()
    """Ids of engines in routing left out of the workers offered because the request failed there (a retry): the
    engines it could go to are those offered and these."""

    @cached_property
    def prompt_key(self) -> TokenKey | str | None:
        """The prompt as token ids (the tree's compact `TokenKey`) or, without ids, as text; of a batch, its
        first prompt. Ids that are not all 32-bit ints (a malformed request the engine will refuse) make no
        key: the request is routed by load, and stays out of the tree."""
        ids = _first(self.body.get("input_ids"))
        if isinstance(ids, list) and ids:
            try:
                return token_key(ids)
            except ValueError:
                pass
        text = _first(self.body.get("text"))
        if isinstance(text, str) and text:
            return text
        return None

    def key_tokens(self, length: int) -> float:
        """Tokens in `length` elements of the prompt key: ids one each, text characters by `chars_per_token`."""
        return length / self.chars_per_token if isinstance(self.prompt_key, str) else length

    @cached_property
    def _sampling(self) -> tuple[int, int, int]:
        """(completion budget, samples per prompt, prompts in the batch), with SGLang's defaults."""
        params = self.body.get("sampling_params")
        params = params[0] if isinstance(params, list) and params else params  # a batch's: one per prompt, alike
        budget, samples = DEFAULT_MAX_NEW_TOKENS, 1
        if isinstance(params, Mapping):
            budget = params.get("max_new_tokens", budget)
            samples = params.get("n", samples)
        prompts = self.body.get("input_ids") or self.body.get("text")
        batch = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (list, str)) else 1
        budget = budget if isinstance(budget, int) and budget >= 0 else DEFAULT_MAX_NEW_TOKENS
        samples = samples if isinstance(samples, int) and samples >= 1 else 1
        return budget, samples, batch

    @cached_property
    def tokens(self) -> int:
        """Estimated tokens the request occupies at the engine: (prompt + completion budget) x samples x prompts."""
        key = self.prompt_key
        prompt = 0 if key is None else math.ceil(self.key_tokens(len(key)))
        budget, samples, batch = self._sampling
        return (prompt + budget) * samples * batch

    @cached_property
    def single_text_chars(self) -> int | None:
        """Characters of the prompt when the request is one raw text prompt with one sample, else None: the
        prompt tokens an engine reports for it then measure the engines' characters per token. Chat messages
        are not raw: the engine adds a chat template the router does not see."""
        key = self.prompt_key
        if not isinstance(key, str) or self._sampling[1:] != (1, 1) or self.route == "/v1/chat/completions":
            return None
        return len(key)


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
    cache_tokens_per_request: int = 40
    """cache_aware: prompt tokens whose prefill costs an engine as much as one more request in flight; the
    exchange rate between cache misses and load in an engine's cost (see `CacheAware`)."""
    balance_abs_threshold: int = 10
    """cache_aware: an engine has room for a prompt's group of requests while its requests in flight plus
    the group stay within this many (at most MAX_SLACK_GROUPS groups) ..."""
    balance_rel_threshold: float = 2.0
    """... plus this factor times the fleet's mean requests in flight per engine (the group counted in; the engine's
    own requests weigh at most MAX_OWN_WEIGHT each)."""
    balance_share_threshold: float = 1.15
    """cache_aware: an engine whose recent requests (about the last 100 routed) exceed this factor times the
    fleet's mean, plus one, takes no new prompt: a popular prompt family spreads once its engines have served
    their share, not only when they are busy."""
    balance_placement_slack: float = 2.0
    """cache_aware: an engine takes a new group or conversation only while, with it, the groups and conversations
    placed on it since the fleet's caches were last emptied (an RL step's weight update) stay within the mean
    per engine plus this many: every engine ends the step with its part of the units, whose later requests
    the share above counts only as they arrive."""
    max_tree_tokens: int = 2**24
    """cache_aware: global budget of the prefix tree, in tokens (characters for text prompts), all engines together."""
    seed: int | None = None
    """power_of_two: seed of its random draws (None: not reproducible)."""


ROUTING_REASONS = ("cache_hit", "imbalance", "low_match", "no_prompt", "least_load", "round_robin", "power_of_two")
"""The reasons the built-in policies give for a choice (`Choice.reason`)."""


class Policy(Protocol):
    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        """Picks one of `workers` (never empty, all healthy) for `request`."""
        ...

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        """The prefix caches of `workers` were emptied (a weight load, a flush, a restart): drop what the
        policy remembers they hold."""
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

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        pass

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

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        pass

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

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        pass

    def forget(self, worker: Worker) -> None:
        pass


class DecayedCounts:
    """Events per worker, each weighed `decay` ** (events counted for any worker since): with a decay below
    1, about the last 1 / (1 - decay) events make up a worker's share; with 1, every event since `clear`."""

    def __init__(self, decay: float, initial: float) -> None:
        self._decay = decay
        self._initial = initial  # what the counts of a fleet none of whose workers is known start at, together
        self._counts: dict[str, tuple[float, int]] = {}  # worker id -> (score, event number it was taken at)
        self._events = 0

    def score(self, worker_id: str) -> float:
        score, at = self._counts.get(worker_id, (0.0, self._events))
        return score * self._decay ** (self._events - at)

    def add(self, worker_id: str) -> None:
        self._counts[worker_id] = (self.score(worker_id) + 1.0, self._events)
        self._events += 1

    def admit(self, worker_ids: Sequence[str]) -> None:
        """Gives each worker not counted yet the mean score of the others, or at first an even part of the
        initial total."""
        new = [w for w in worker_ids if w not in self._counts]
        if not new:
            return
        known = [self.score(w) for w in worker_ids if w in self._counts]
        prior = sum(known) / len(known) if known else self._initial / len(worker_ids)
        for worker_id in new:
            self._counts[worker_id] = (prior, self._events)

    def clear(self) -> None:
        self._counts.clear()

    def pop(self, worker_id: str) -> None:
        self._counts.pop(worker_id, None)


class CacheAware:
    """Follows the engines' prefix caches while the fleet stays balanced, placing a GRPO group or a
    conversation as one unit.

    The tree records, for every prompt routed, the engine it went to and where the prompt ended, so the
    samples of a prompt sent one after another find where the first one went before any engine has
    answered, and a conversation's next turn (its previous prompt, the answer and a new message) finds
    where the previous turn went. The policy also estimates the group size G, the requests per distinct
    prompt (the n samples of a GRPO prompt sent one by one: n; multi-turn turns: 1), as the last
    GROUP_SIZE_WINDOW requests over the prompts among them that no engine held whole, at most MAX_GROUP_SIZE.
    An engine's slack is `balance_abs_threshold` requests, but at most MAX_SLACK_GROUPS groups.
      * A prompt that repeats or continues one routed to an engine (a group's later sample, a conversation's
        next turn) follows it there while that engine has fewer than slack + `balance_rel_threshold` x the
        mean in flight + G requests in flight (the mean counting the engine's own requests at most
        MAX_OWN_WEIGHT each, so that one whose requests never end fills up on any fleet): room was checked
        when the group or conversation was placed, so it is split only when its engine is overloaded, and its
        question or history is prefilled once.
      * Any other prompt goes to one of the engines with room for its whole group: in flight + G within
        slack + `balance_rel_threshold` x the mean with the group counted in (or idle), and recent requests
        within `balance_share_threshold` x the mean + 1. Recent requests are the requests routed to the
        engine, each weighed RECENT_DECAY ** (requests routed anywhere since): its part of about the last
        100 (an engine new to the policy starts at the mean). The first bound keeps the engines' queues
        even at each moment; the second keeps their shares of the traffic even over time, so a popular
        prompt family spreads to another engine once its engines have served their share. A third bound
        counts what the second sees only as it arrives, a conversation's later turns: the groups and
        conversations placed on the engine since the fleet's caches were last emptied (an RL step's weight
        update) stay, with this one, within the mean per engine + `balance_placement_slack`. Among them, cost
        decides: requests in flight plus the prompt tokens the engine would have to prefill (what the tree
        says it does not hold; text in the engines' characters per token, see `CharsPerToken`) at
        `cache_tokens_per_request` tokens to one request. A prompt family therefore spreads only when its
        engines are full. No engine holding `cache_threshold` of the prompt: the least-loaded engine with
        room (low_match). No engine with room: the shares give way to the load, and the cheapest engine whose
        requests in flight leave room for the group takes it, else the least loaded (imbalance): an engine
        that stopped answering (hung, its requests never done) gets no new prompt while another has room.
    A match below `cache_threshold` counts as none everywhere, so a short prefix all traffic shares (a chat
    template's header) does not make the engines that served something cheaper than an idle one. Ties go
    to the longer match, then to the engine with the fewest requests routed to it lately, so an idle fleet
    fills every engine instead of the first ones in its list. The reason is cache_hit when the chosen
    engine holds the longest prefix any engine holds, else imbalance.
    """

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options or PolicyOptions()
        self.tree = RadixTree(self.options.max_tree_tokens)
        self._window: deque[bool] = deque(maxlen=GROUP_SIZE_WINDOW)  # per recent request: a new prompt?
        self._new_prompts = 0  # True entries in the window
        self._recent = DecayedCounts(RECENT_DECAY, 1 / (1 - RECENT_DECAY))  # requests routed to each engine
        # Groups and conversations placed on each engine since the fleet's caches were last emptied.
        self._placed = DecayedCounts(1.0, 0.0)
        # The engines the last request could go to: a retry offered only the engines it did not fail at names the
        # others (`RoutingRequest.excluded`), so emptying those it is offered does not pass for a new step.
        self._routable: frozenset[str] = frozenset()

    @property
    def group_size(self) -> float:
        """Estimated requests per distinct prompt: recent requests over the new prompts among them (1 at first)."""
        return min(MAX_GROUP_SIZE, len(self._window) / self._new_prompts) if self._new_prompts else 1.0

    def _count(self, new_prompt: bool) -> None:
        if len(self._window) == self._window.maxlen:
            self._new_prompts -= self._window[0]
        self._window.append(new_prompt)
        self._new_prompts += new_prompt

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        assert workers, "select() needs at least one worker"
        self._admit(workers)
        self._routable = frozenset(w.id for w in workers) | request.excluded
        key = request.prompt_key
        if key is None:
            least_loaded = min(workers, key=lambda w: (w.in_flight, self._recent_score(w), w.in_flight_tokens))
            choice = Choice(least_loaded, "no_prompt")
        else:
            choice = self._choose(workers, request)
            self.tree.insert(key, choice.worker.id)
        self._recent.add(choice.worker.id)
        return choice

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        self.tree.remove_tenants([w.id for w in workers])
        if self._routable <= {w.id for w in workers}:  # every engine routed to: a new step (a weight update)
            self._placed.clear()

    def forget(self, worker: Worker) -> None:
        self.forget_caches([worker])
        self._recent.pop(worker.id)
        self._placed.pop(worker.id)

    def _admit(self, workers: Sequence[Worker]) -> None:
        """Gives each engine new to the policy the mean recent share, or at first an even part of what the
        counts cover: a fresh router or engine is judged against its share once it has had time to serve
        one, so the first requests of a family do not spread it over an idle fleet."""
        ids = [w.id for w in workers]
        self._recent.admit(ids)
        self._placed.admit(ids)

    def _recent_score(self, worker: Worker) -> float:
        return self._recent.score(worker.id)

    def _choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        opts = self.options
        key = request.prompt_key
        assert key is not None
        size = len(key)
        match = self.tree.match(key)
        # A match below the threshold counts as none: a short prefix every prompt shares (a chat template's
        # header) must not make the engines that served anything cheaper than one that is idle.
        floor = opts.cache_threshold * size
        held = {w.id: n if (n := match.matched.get(w.id, 0)) >= floor else 0 for w in workers}
        longest = max(held.values())
        group = self.group_size  # before this request counts: a new prompt is where its group starts
        self._count(longest < size)
        in_flight = sum(w.in_flight for w in workers)
        slack = min(opts.balance_abs_threshold, MAX_SLACK_GROUPS * group)
        rel, engines = opts.balance_rel_threshold, len(workers)
        own = min(rel / engines, MAX_OWN_WEIGHT)

        def bound(w: Worker, placed: float = 0) -> float:
            # slack + rel x the fleet's mean in flight (with `placed` more), the engine's own requests weighing `own`
            return slack + rel * (in_flight - w.in_flight + placed) / engines + own * w.in_flight

        # An engine holding nothing is not followed, whatever the threshold (0 included).
        extended = {w.id: n for w in workers if (n := match.extended.get(w.id, 0)) > 0 and n >= floor}
        followed = [w for w in workers if w.id in extended and w.in_flight < bound(w) + group]
        if followed:
            best = min(followed, key=lambda w: (-extended[w.id], w.in_flight, self._recent_score(w)))
            return Choice(best, "cache_hit" if held[best.id] == longest else "imbalance")
        # Against the mean rather than the least-loaded engine: one idle engine must not make every other
        # one full, and a fleet with more engines than prompt families still fills them all. An idle engine
        # always has room, whatever the group size estimate (it lags when the traffic changes).
        recent = {w.id: self._recent_score(w) for w in workers}
        share = opts.balance_share_threshold * (sum(recent.values()) + group) / len(workers) + 1
        placed = {w.id: self._placed.score(w.id) for w in workers}
        most_placed = (sum(placed.values()) + 1) / len(workers) + opts.balance_placement_slack
        not_full = [w for w in workers if w.in_flight + group <= max(bound(w, group), group)]
        room = [w for w in not_full if recent[w.id] <= share and placed[w.id] + 1 <= most_placed]

        def cost(w: Worker) -> tuple[float, int, float]:
            prefill = request.key_tokens(size - held[w.id])
            return w.in_flight + prefill / opts.cache_tokens_per_request, -held[w.id], recent[w.id]

        if room:
            best = min(room, key=cost)
            reason = "low_match" if longest == 0 else "cache_hit" if held[best.id] == longest else "imbalance"
            choice = Choice(best, reason)
        elif not_full:
            # Every engine with room for the group has served its share: the shares give way to the load.
            choice = Choice(min(not_full, key=cost), "imbalance")
        else:
            choice = Choice(min(workers, key=lambda w: (w.in_flight, recent[w.id])), "imbalance")
        self._placed.add(choice.worker.id)
        return choice


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
