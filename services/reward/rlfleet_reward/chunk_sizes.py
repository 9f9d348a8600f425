"""How many items a chunk holds: about `CHUNK_SECONDS` of the function's work, as its items took so far.

A chunk holds its worker until its last item is done, so a request that arrives meanwhile waits that long
for a worker: chunks of 32 `code` items (1.3 s each) made a one-item `exact` request wait 41 s. A chunk is
therefore sized by time rather than count, from the seconds per item the function's recent chunks took (at
least one item): a request waits about `CHUNK_SECONDS` for the next free worker, and a fast function
(microseconds an item) still sends many items per message, so the hub's event loop wakes once per chunk,
not per item. It is also at most a share of the items the call has left, `1 / (CHUNKS_PER_WORKER x
workers)`, so a batch spreads over every worker and its last chunks are single items that end together.

The function's earlier chunks say nothing about a new call's items, which may be far slower (other params,
harder responses): sized by a fast batch before, 160 items of 0.5 s went out in chunks of 40, and a one-item
request waited 15 s. So each lane of a call (`worker_pool`) sends one item first, and sizes its next chunks
only once that item is back. A chunk slower than the estimate replaces it at once, so a switch to slow items
is not followed by a large chunk of them; a faster one moves it halfway, so one quick chunk among slow ones
does not either.
"""

from __future__ import annotations

from collections.abc import Iterable

CHUNK_SECONDS = 0.2
CHUNKS_PER_WORKER = 2


class ChunkSizes:
    def __init__(self) -> None:
        self._seconds_per_item: dict[str, float] = {}

    def size(self, function: str, left: int, workers: int, timed: bool) -> int:
        """Items in the next chunk of `function`, whose call has `left` items not yet sent, on `workers`;
        `timed`: a chunk of this lane of the call is back, so the estimate has seen the call's items."""
        share = -(-left // (CHUNKS_PER_WORKER * workers))
        per_item = self._seconds_per_item.get(function)
        if not timed or per_item is None:
            return 1
        by_time = int(CHUNK_SECONDS / per_item) if per_item > 0 else share
        return max(1, min(share, by_time))

    def observe(self, function: str, seconds: Iterable[float]) -> None:
        """Records the seconds each item of a chunk of `function` took."""
        taken = list(seconds)
        if not taken:
            return
        mean = sum(taken) / len(taken)
        known = self._seconds_per_item.get(function)
        self._seconds_per_item[function] = mean if known is None or mean > known else (known + mean) / 2
