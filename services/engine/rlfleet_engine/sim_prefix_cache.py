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

A held block is cached, for a lease, only once its KV exists: it was computed in an earlier iteration of
the scheduler (`begin_iteration`), or in this one by the same prefill group (the n samples of one prompt,
which SGLang prefills once), and under the current weights. Two requests admitted together are one prefill
batch: neither saves what the other computes. After `invalidate` (a weight load that flushes the cache)
the blocks running requests still pin hold the old weights' KV: stale, never cached, dropped when their
last lease ends unless a prefill under the new weights computed them again (`recompute`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
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
        self._computed_in: dict[int, int] = {}
        """Held block -> the iteration whose prefill (or decode, for a finished output) computed its KV."""
        self._computed_by: dict[int, set[Hashable]] = {}
        """Block computed in the current iteration -> the prefill groups that computed it."""
        self._stale: set[int] = set()
        """Pinned blocks holding KV of weights a load has replaced."""
        self.iteration = 0
        self.private_tokens = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens of the blocks held, pinned or not (the memory they take)."""
        return (len(self._evictable) + len(self._pins)) * self.block_size

    @property
    def cached_tokens(self) -> int:
        """Tokens of the blocks held with KV of the current weights (what a later prompt can match)."""
        return self.tokens - len(self._stale) * self.block_size

    @property
    def pinned_tokens(self) -> int:
        """Tokens of the blocks running requests hold, shared ones counted once."""
        return len(self._pins) * self.block_size

    @property
    def in_use_tokens(self) -> int:
        """Tokens reserved for running requests (neither free nor evictable): pinned blocks, and private tokens
        with room for all of max_new_tokens. What admission counts; SGLang's `num_used_tokens` is less."""
        return len(self._pins) * self.block_size + self.private_tokens

    def begin_iteration(self) -> None:
        """A new scheduler iteration: what the last one computed is cached for every request from now on."""
        self.iteration += 1
        self._computed_by.clear()

    def _chain(self, ids: Sequence[int]) -> Iterator[int]:
        digest = 0
        size = self.block_size
        for start in range(0, len(ids) - size + 1, size):
            digest = hash((digest, *ids[start : start + size]))
            yield digest

    def _held(self, digest: int) -> bool:
        return digest in self._pins or digest in self._evictable

    def _valid(self, digest: int) -> bool:
        return self._held(digest) and digest not in self._stale

    def _cached_for(self, digest: int, group: Hashable) -> bool:
        """Whether `group`'s prefill in this iteration finds `digest`'s KV computed."""
        if not self._valid(digest):
            return False
        return self._computed_in[digest] < self.iteration or group in self._computed_by.get(digest, ())

    def _leading(self, chain: Iterable[int], held: bool, group: Hashable = None) -> int:
        """Blocks at the start of `chain` held with valid KV (`held`), or cached for `group`."""
        count = 0
        for digest in chain:
            if not (self._valid(digest) if held else self._cached_for(digest, group)):
                break
            count += 1
        return count

    def match(self, ids: Sequence[int]) -> int:
        """Tokens at the start of `ids` the cache holds with KV of the current weights (a multiple of the block
        size), computed by now or being computed in this iteration; a look, not a lookup: only a granted lease
        counts in the hit rate."""
        return self._leading(self._chain(ids), held=True) * self.block_size

    def _computed(self, digest: int, iteration: int) -> None:
        """Records that `digest`'s KV was computed (under the current weights) in `iteration`: no longer stale."""
        self._stale.discard(digest)
        self._computed_in[digest] = iteration

    def insert(self, ids: Sequence[int]) -> None:
        """Holds every whole block of `ids` from now on, evicting the least recently used blocks beyond the budget.
        Their KV exists already (a finished sequence's): cached for every lease from now on, even in this iteration
        (so a cache used without iterations, as a replay is, counts every block it holds)."""
        for digest in reversed(list(self._chain(ids))):
            if digest not in self._pins:
                self._evictable[digest] = None
                self._evictable.move_to_end(digest)
            if digest not in self._computed_in or digest in self._stale:
                self._computed(digest, self.iteration - 1)
        self._evict()

    def lease(self, ids: Sequence[int], extra_tokens: int, group: Hashable = None) -> Lease | None:
        """Pins the whole blocks of `ids`, reserves their partial tail + `extra_tokens`; None if that cannot fit now.

        It fits if the blocks not yet held plus the private tokens fit in the free memory plus what can
        be evicted, not counting held blocks of `ids` itself (pinning them makes them unevictable). Its
        cached tokens are the leading blocks cached for `group` (the request's prefill group: the n samples
        of a prompt share one); the prefill of this iteration computes the rest. A granted lease counts as
        a lookup in the hit rate; a refused one does not, since it is asked again later, as SGLang matches
        a waiting request again each time it tries to schedule it.
        """
        chain = tuple(self._chain(ids))
        private = len(ids) - len(chain) * self.block_size + extra_tokens
        new_blocks = sum(1 for digest in chain if not self._held(digest))
        reused_evictable = sum(1 for digest in chain if digest in self._evictable)
        free = self.max_tokens - self.tokens - self.private_tokens
        room = free + (len(self._evictable) - reused_evictable) * self.block_size
        if new_blocks * self.block_size + private > room:
            return None
        cached_blocks = self._leading(chain, held=False, group=group)
        cached = self._cached_tokens(ids, cached_blocks)
        self.lookup_tokens += len(ids)
        self.hit_tokens += cached
        for digest in chain:
            self._evictable.pop(digest, None)
            self._pins[digest] = self._pins.get(digest, 0) + 1
        self.recompute(chain[cached_blocks:], group)
        self.private_tokens += private
        self._evict()
        return Lease(chain, private, cached)

    def cached_for(self, ids: Sequence[int], group: Hashable = None) -> int:
        """The cached tokens a lease of `ids` for `group` would get now (nothing pinned, nothing counted): what
        the scheduler weighs against its prefill budget before it leases."""
        return self._cached_tokens(ids, self._leading(self._chain(ids), held=False, group=group))

    def _cached_tokens(self, ids: Sequence[int], cached_blocks: int) -> int:
        # At least the last prompt token is computed, as in SGLang, to produce the first output token.
        return min(cached_blocks * self.block_size, max(len(ids) - 1, 0))

    def recompute(self, blocks: Iterable[int], group: Hashable = None) -> None:
        """`group`'s prefill in this iteration computes the KV of these pinned `blocks` (a new request's uncached
        blocks, or a held request's after a weight load): cached for others from the next iteration on."""
        for digest in blocks:
            if digest in self._stale or self._computed_in.get(digest, self.iteration) == self.iteration:
                self._computed(digest, self.iteration)
                self._computed_by.setdefault(digest, set()).add(group)
            # else: KV computed in an earlier iteration, held past a block this lease lacked; it stays as it is.

    def release(self, lease: Lease, ids: Sequence[int]) -> None:
        """Ends a lease and keeps the finished sequence `ids` (prompt + output) cached, as SGLang does; `ids` is
        empty for a request whose KV is stale (computed under replaced weights): nothing of it is kept."""
        for digest in reversed(lease.blocks):
            if self._pins[digest] > 1:
                self._pins[digest] -= 1
                continue
            del self._pins[digest]
            if digest in self._stale:
                self._drop(digest)
            else:
                self._evictable[digest] = None
        self.private_tokens -= lease.private_tokens
        self.insert(ids)

    def _drop(self, digest: int) -> None:
        self._stale.discard(digest)
        self._computed_in.pop(digest, None)
        self._computed_by.pop(digest, None)

    def _evict(self) -> None:
        while self.tokens + self.private_tokens > self.max_tokens and self._evictable:
            self._drop(self._evictable.popitem(last=False)[0])

    def clear(self) -> None:
        """Drops every evictable block; running requests keep their leases (their KV is still in use)."""
        for digest in self._evictable:
            self._drop(digest)
        self._evictable.clear()

    def invalidate(self) -> None:
        """The weights changed (a load that flushes the cache): drops every evictable block, and marks the pinned
        ones stale, so none is cached for any request until computed again (`recompute`)."""
        self.clear()
        self._stale = set(self._pins)
        self._computed_by.clear()

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
