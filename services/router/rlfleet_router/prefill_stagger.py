"""The prefill stagger: how long a request waits before it is sent, so that it shares its prompt's prefill.

SGLang (with its default fcfs schedule) shares nothing within one prefill batch: two requests for the same
uncached prompt that reach an engine before its next scheduling iteration both compute the whole prompt, while
one that arrives once the first's prefill iteration has begun waits for it and finds the prompt cached. The
cache_aware policy places a GRPO group (the n samples of one prompt, sent as separate requests at about the same
moment) on one engine, so without a stagger its samples often land in one batch and each pays the full prefill.

So a request whose prompt was sent to the same engine less than `stagger_secs` ago by a request still in flight
there (the prompt's first dispatch) waits until that first dispatch + `stagger_secs`. Nothing else waits: not a
request to another engine, nor another prompt, nor a repeat once the first has ended (the prompt is cached, or
the first failed) or is older than the stagger (its prefill has begun; this request is a first dispatch again).
The wait is bounded by the stagger and never depends on the first's answer.

State is one entry per (engine, prompt digest) first dispatched within the stagger, pruned as it ages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from rlfleet_router.radix_tree import TokenKey


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
        # (engine id, prompt digest) -> (time of the prompt's first dispatch there, that dispatch). Inserted in
        # time order (an entry made anew is removed first), so the oldest entries are the first ones.
        self._firsts: dict[tuple[str, int], tuple[float, Dispatch]] = {}

    def __len__(self) -> int:
        return len(self._firsts)

    def delay(self, engine_id: str, key: TokenKey | str | None, dispatch: Dispatch) -> float:
        """Seconds `dispatch`, of prompt `key` to engine `engine_id`, waits before it is sent (0: none). A dispatch
        that waits for none and finds no recent first dispatch of the prompt there is recorded as one."""
        if not self.stagger_secs or key is None:
            return 0.0
        now = self._clock()
        self._prune(now)
        # A digest, not the prompt: entries stay small. A collision (64 bits) costs one request a short wait.
        entry = (engine_id, hash(key if isinstance(key, str) else key.tobytes()))
        first = self._firsts.get(entry)
        if first is None:
            self._firsts[entry] = (now, dispatch)
            return 0.0
        at, first_dispatch = first
        return 0.0 if first_dispatch.ended else max(0.0, at + self.stagger_secs - now)

    def forget(self, engine_id: str) -> None:
        """`engine_id` left the fleet: its first dispatches go."""
        for entry in [entry for entry in self._firsts if entry[0] == engine_id]:
            del self._firsts[entry]

    def _prune(self, now: float) -> None:
        """Drops the first dispatches `stagger_secs` old or older: nothing waits for them any more."""
        firsts = self._firsts
        while firsts:
            entry = next(iter(firsts))
            if now - firsts[entry][0] < self.stagger_secs:
                return
            del firsts[entry]
