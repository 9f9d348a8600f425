"""Run store: the run queue's look and the runs-by-state count, as the store grows, against reading every record.

Records are kept after their runs end, so a long-lived fleet's store holds every run it ever ran. The run queue
looks for its QUEUED and RUNNING runs every 5 s (and on every wake-up), and the runs-by-state gauge is counted
every 5 s; both read the store's state sets. The baseline is what they did before those sets: page through every
record in creation order (1000 a round trip) and keep the runs in the states asked for, or count them all.

For each store size the bench writes that many runs (records of about --record-bytes bytes, a few QUEUED and
RUNNING, the rest SUCCEEDED, FAILED or CANCELLED) into a fresh key prefix of a real Redis, times each way
--repeats times (alternating which goes first) and prints the medians and their ratio. The keys it made are
deleted at the end. Run:

    .venv/bin/python bench/run_store_scaling.py [--runs 1000 5000 20000] [--repeats 20]
        [--record-bytes 600] [--redis-url redis://127.0.0.1:6379/0]

Record the printed figures in bench/run_store_scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.run_store import MAX_PAGE_SIZE, RunStore

ACTIVE = (RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_QUEUED)
ENDED = (RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED, RunState.RUN_STATE_CANCELLED)


async def every_record(store: RunStore) -> list[Run]:
    """The baseline: every run, read page by page in creation order."""
    runs, token = await store.page(page_size=MAX_PAGE_SIZE)
    while token:
        page, token = await store.page(page_size=MAX_PAGE_SIZE, page_token=token)
        runs += page
    return runs


async def scanned_queue(store: RunStore) -> list[Run]:
    return [run for run in await every_record(store) if run.state in ACTIVE]


async def scanned_counts(store: RunStore) -> Counter[RunState]:
    return Counter(run.state for run in await every_record(store))


async def fill(store: RunStore, total: int, record_bytes: int) -> None:
    """Adds runs until the store holds `total`: three active (the last ones), the rest ended."""
    have = int(await store.client.zcard(store.index_key))
    for i in range(have, total):
        state = ACTIVE[i % 2] if i >= total - 3 else ENDED[i % 3]
        run = Run(id=f"run-{i:07}", state=state)
        run.spec.name = "x" * max(0, record_bytes - run.ByteSize() - 3)
        await store.create(run)
        if (i + 1) % 5000 == 0:
            print(f"  stored {i + 1}/{total} runs", flush=True)
    # The bench keeps writing active runs at the end; earlier active ones end as the store grows.
    last = {f"run-{i:07}" for i in range(total - 3, total)}
    for run in await store.all_in_order(ACTIVE):
        if run.id not in last:
            await store.update(run.id, end, expire_data_after_s=60)


def end(run: Run) -> None:
    run.state = RunState.RUN_STATE_SUCCEEDED


async def timed(call: Callable[[], Awaitable[object]], times: list[float]) -> None:
    start = time.perf_counter()
    await call()
    times.append(time.perf_counter() - start)


async def measure(store: RunStore, repeats: int) -> dict[str, float]:
    queue = await store.all_in_order(ACTIVE)
    assert [r.id for r in queue] == [r.id for r in await scanned_queue(store)], "the two ways disagree"
    assert await store.count_by_state() == await scanned_counts(store), "the two counts disagree"
    times: dict[str, list[float]] = {name: [] for name in ("queue", "queue_scan", "count", "count_scan")}
    for i in range(repeats):
        pairs = [
            (lambda: store.all_in_order(ACTIVE), "queue"),
            (lambda: scanned_queue(store), "queue_scan"),
            (store.count_by_state, "count"),
            (lambda: scanned_counts(store), "count_scan"),
        ]
        for call, name in pairs if i % 2 == 0 else reversed(pairs):
            await timed(call, times[name])
    return {name: statistics.median(values) for name, values in times.items()}


async def main(args: argparse.Namespace) -> None:
    prefix = f"bench-run-store-{uuid.uuid4().hex[:8]}:"
    client = aioredis.Redis.from_url(args.redis_url, socket_timeout=30)
    store = RunStore(client, prefix)
    try:
        print(f"key prefix {prefix}; record {args.record_bytes} B; median of {args.repeats} each")
        print(
            "| runs stored | queue look: state sets | reading every record | ratio "
            "| count: state sets | reading every record | ratio |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for total in sorted(args.runs):
            await fill(store, total, args.record_bytes)
            m = await measure(store, args.repeats)
            print(
                f"| {total} | {m['queue'] * 1e3:.2f} ms | {m['queue_scan'] * 1e3:.1f} ms | "
                f"**{m['queue_scan'] / m['queue']:.0f}x** | {m['count'] * 1e3:.2f} ms | "
                f"{m['count_scan'] * 1e3:.1f} ms | **{m['count_scan'] / m['count']:.0f}x** |",
                flush=True,
            )
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
        await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[1000, 5000, 20000], help="store sizes to measure")
    parser.add_argument("--repeats", type=int, default=20, help="timings of each way per size (median reported)")
    parser.add_argument("--record-bytes", type=int, default=600, help="size of each run record")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the Redis to use (a fresh prefix)")
    asyncio.run(main(parser.parse_args()))
