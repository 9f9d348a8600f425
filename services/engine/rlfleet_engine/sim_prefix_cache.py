"""The `sim` backend's prefix cache: which prompt prefixes one engine still holds, within a token budget.

Sequences are cut into fixed-size blocks and each block is named by a hash chained over all blocks
before it (the scheme of paged KV caches with automatic prefix caching), so a lookup walks the
prompt block by block and stops at the first block the cache does not hold. Eviction is LRU over
blocks; a touched sequence is refreshed from its last block to its first, so a prefix is always at
least as recent as its extensions and the tails of sequences go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class PrefixCache:
    def __init__(self, max_tokens: int, block_size: int = 16) -> None:
        if max_tokens < block_size or block_size < 1:
            raise ValueError(f"max_tokens ({max_tokens}) must be at least one block ({block_size} tokens)")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @property
    def tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def _chain(self, ids: Sequence[int]) -> Iterator[int]:
        digest = 0
        size = self.block_size
        for start in range(0, len(ids) - size + 1, size):
            digest = hash((digest, *ids[start : start + size]))
            yield digest

    def match(self, ids: Sequence[int]) -> int:
        """Tokens at the start of `ids` the cache holds (a multiple of the block size); counted in the hit rate."""
        held = 0
        for digest in self._chain(ids):
            if digest not in self._blocks:
                break
            held += self.block_size
        self.lookup_tokens += len(ids)
        self.hit_tokens += held
        return held

    def insert(self, ids: Sequence[int]) -> None:
        """Holds every whole block of `ids` from now on, evicting the least recently used blocks beyond the budget."""
        chain = list(self._chain(ids))
        for digest in reversed(chain):
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) * self.block_size > self.max_tokens:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
