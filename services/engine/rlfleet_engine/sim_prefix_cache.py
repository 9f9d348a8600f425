"""The `sim` backend's KV memory: the prefix cache and the running requests' KV, in one token budget.

Sequences are cut into fixed-size blocks and each block is named by a hash chained over all blocks
before it (the scheme of paged KV caches with automatic prefix caching), so a lookup walks the
prompt block by block and stops at the first block the cache does not hold.

As in SGLang's KV pool, the budget holds both what running requests use and what finished ones
left behind. A running request holds a `Lease`: its prompt's whole blocks are pinned (a block
shared by several running requests is pinned once per request and counted once), and the rest of
its KV (the prompt's last partial block and room for all of `max_new_tokens`: SGLang reserves this
room too, scaled by its estimate of how much of it requests use) is private. Only unpinned blocks
can be evicted, least recently used first; a touched sequence is refreshed from its last block to
its first, so a prefix is always at least as recent as its extensions and the tails of sequences
go first. A lease is granted only if it fits in free plus evictable memory, so a running request
never needs memory it cannot get.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    """What one running request holds: its prompt's pinned blocks and its private tokens."""

    blocks: tuple[int, ...]
    private_tokens: int
    cached_tokens: int
    """Prompt tokens the cache held when the lease was granted (whole blocks), short of the last one, which an
    engine always computes for its logits (SGLang's `cached_tokens`): the prefill it saves."""


class PrefixCache:
    def __init__(self, max_tokens: int, block_size: int = 16) -> None:
        if max_tokens < block_size or block_size < 1:
            raise ValueError(f"max_tokens ({max_tokens}) must be at least one block ({block_size} tokens)")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        """Pinned block -> number of leases pinning it; these blocks are never evicted."""
        self.private_tokens = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens of the blocks held, pinned or not (what a later prompt can match)."""
        return (len(self._evictable) + len(self._pins)) * self.block_size

    @property
    def in_use_tokens(self) -> int:
        """Tokens held for running requests (SGLang's `num_used_tokens`: neither free nor evictable)."""
        return len(self._pins) * self.block_size + self.private_tokens

    def _chain(self, ids: Sequence[int]) -> Iterator[int]:
        digest = 0
        size = self.block_size
        for start in range(0, len(ids) - size + 1, size):
            digest = hash((digest, *ids[start : start + size]))
            yield digest

    def _held(self, digest: int) -> bool:
        return digest in self._pins or digest in self._evictable

    def _held_prefix(self, chain: Iterable[int]) -> int:
        """Tokens of the held blocks at the start of `chain`."""
        held = 0
        for digest in chain:
            if not self._held(digest):
                break
            held += self.block_size
        return held

    def match(self, ids: Sequence[int]) -> int:
        """Tokens at the start of `ids` the cache holds (a multiple of the block size); a look, not a lookup:
        only a granted lease counts in the hit rate."""
        return self._held_prefix(self._chain(ids))

    def insert(self, ids: Sequence[int]) -> None:
        """Holds every whole block of `ids` from now on, evicting the least recently used blocks beyond the budget."""
        for digest in reversed(list(self._chain(ids))):
            if digest not in self._pins:
                self._evictable[digest] = None
                self._evictable.move_to_end(digest)
        self._evict()

    def lease(self, ids: Sequence[int], extra_tokens: int) -> Lease | None:
        """Pins the whole blocks of `ids`, reserves their partial tail + `extra_tokens`; None if that cannot fit now.

        It fits if the blocks not yet held plus the private tokens fit in the free memory plus what can
        be evicted, not counting held blocks of `ids` itself (pinning them makes them unevictable). A
        granted lease counts as a lookup in the hit rate; a refused one does not, since it is asked
        again later, as SGLang matches a waiting request again each time it tries to schedule it.
        """
        chain = tuple(self._chain(ids))
        private = len(ids) - len(chain) * self.block_size + extra_tokens
        new_blocks = sum(1 for digest in chain if not self._held(digest))
        reused_evictable = sum(1 for digest in chain if digest in self._evictable)
        free = self.max_tokens - self.tokens - self.private_tokens
        room = free + (len(self._evictable) - reused_evictable) * self.block_size
        if new_blocks * self.block_size + private > room:
            return None
        cached = min(self._held_prefix(chain), max(len(ids) - 1, 0))
        self.lookup_tokens += len(ids)
        self.hit_tokens += cached
        for digest in chain:
            self._evictable.pop(digest, None)
            self._pins[digest] = self._pins.get(digest, 0) + 1
        self.private_tokens += private
        self._evict()
        return Lease(chain, private, cached)

    def release(self, lease: Lease, ids: Sequence[int]) -> None:
        """Ends a lease and keeps the finished sequence `ids` (prompt + output) cached, as SGLang does."""
        for digest in reversed(lease.blocks):
            if self._pins[digest] > 1:
                self._pins[digest] -= 1
            else:
                del self._pins[digest]
                self._evictable[digest] = None
        self.private_tokens -= lease.private_tokens
        self.insert(ids)

    def _evict(self) -> None:
        while self.tokens + self.private_tokens > self.max_tokens and self._evictable:
            self._evictable.popitem(last=False)

    def clear(self) -> None:
        """Drops every evictable block; running requests keep their leases (their KV is still in use)."""
        self._evictable.clear()

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
