"""The prefill stagger: how long a request waits before it is sent, so that it shares its prompt's prefill.

SGLang (with its default fcfs schedule) shares nothing within one prefill batch: two requests for the same
uncached prompt that reach an engine before its next scheduling iteration both compute the whole prompt, while
one that arrives once the first's prefill iteration has begun waits for it and finds the prompt cached. The
cache_aware policy places a GRPO group (the n samples of one prompt, sent as separate requests at about the same
moment) on one engine, so without a stagger its samples often land in one batch and each pays the full prefill.

The same holds for prompts that share most of their text without being equal: the questions of one GRPO prompt
family after its long shared context, the first turns of conversations on one system prompt. Each arriving in the
same batch computes the shared part again (on a fleet just emptied by a weight update, 32 conversations opening
at once on three system prompts prefilled them 34 times on 4 engines instead of a dozen).

So a request whose prompt was sent to the same engine less than `stagger_secs` ago by a request still in flight
there (the prompt's first dispatch) waits until that first dispatch + `stagger_secs`; and a request whose prompt
is new there but shares at least SHARED_FRACTION of itself with a first dispatch still in flight there waits the
same way for it, and is recorded as its own prompt's first dispatch from the moment it is sent. Nothing else
waits: not a request to another engine, nor a prompt with less in common, nor a request once the first has ended
(its prompt is cached, or it failed) or is older than the stagger (its prefill has begun). The wait is bounded by
the stagger and never depends on the first's answer.

State is one entry per (engine, prompt digest) first dispatched within the stagger, with its prompt, pruned as it
ages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from rlfleet_router.radix_tree import TokenKey, common_length

# A new prompt waits for a prompt in flight at its engine that shares at least this part of it.
SHARED_FRACTION = 0.5


class Dispatch(Protocol):
    """A request sent to an engine (the proxy's `Attempt`): in flight there until it has ended."""

    @property
    def ended(self) -> bool: ...


class PrefillStagger:
    def __init__(self, stagger_secs: float, clock: Callable[[], float] = time.monotonic) -> None:
        if stagger_secs < 0:
            raise ValueError(f"prefill stagger must be >= 0 seconds (0 turns it off), got {stagger_secs}")
        self.stagger_secs = stagger_secs
        self._clock = clock
        # (engine id, prompt digest) -> (when the prompt's first dispatch there is sent, that dispatch, the prompt).
        self._firsts: dict[tuple[str, int], tuple[float, Dispatch, TokenKey | str]] = {}

    def __len__(self) -> int:
        return len(self._firsts)

    def delay(self, engine_id: str, key: TokenKey | str | None, dispatch: Dispatch) -> float:
        """Seconds `dispatch`, of prompt `key` to engine `engine_id`, waits before it is sent (0: none). A dispatch
        that finds no recent first dispatch of its prompt there is recorded as one, sent after its wait."""
        if not self.stagger_secs or key is None:
            return 0.0
        now = self._clock()
        self._prune(now)
        # A digest, not the prompt: a collision (64 bits) costs one request a short wait.
        entry = (engine_id, hash(key if isinstance(key, str) else key.tobytes()))
        first = self._firsts.get(entry)
        if first is not None:
            at, first_dispatch, _ = first
            return 0.0 if first_dispatch.ended else max(0.0, at + self.stagger_secs - now)
        wait = self._shared_prefix_wait(engine_id, key, now)
        self._firsts[entry] = (now + wait, dispatch, key)
        return wait

    def _shared_prefix_wait(self, engine_id: str, key: TokenKey | str, now: float) -> float:
        """Until when a new prompt waits for another prompt in flight at the engine with most of it in common (a
        GRPO family's other question, a conversation on the same system prompt): the shortest wait among them."""
        shared = SHARED_FRACTION * len(key)
        waits = [
            at + self.stagger_secs - now
            for (engine, _), (at, first_dispatch, other) in self._firsts.items()
            if engine == engine_id
            and not first_dispatch.ended
            and type(other) is type(key)
            and common_length(key, 0, other) >= shared
        ]
        return max(0.0, min(waits)) if waits else 0.0

    def forget(self, engine_id: str) -> None:
        """`engine_id` left the fleet: its first dispatches go."""
        for entry in [entry for entry in self._firsts if entry[0] == engine_id]:
            del self._firsts[entry]

    def _prune(self, now: float) -> None:
        """Drops the first dispatches sent `stagger_secs` ago or longer: nothing waits for them any more."""
        stale = [entry for entry, (at, _, _) in self._firsts.items() if now - at >= self.stagger_secs]
        for entry in stale:
            del self._firsts[entry]
