"""Sustained concurrent load from the test process, with the latency, errors and memory it saw.

`concurrency` clients each send their next request as soon as the last one is answered, for `seconds`;
the service's resident memory is sampled once a second from /proc, so a leak shows as growth between
the first and the last third of the run.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# Full form: `make test-load` (RLFLEET_LOAD_SECONDS=25); CI runs the same tests for a few seconds.
LOAD_SECONDS = float(os.environ.get("RLFLEET_LOAD_SECONDS", "6"))

Request = Callable[[httpx.AsyncClient, int], Awaitable[httpx.Response]]


@dataclass
class LoadResult:
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    rss_mib: list[float] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.latencies) + self.transport_errors

    @property
    def error_rate(self) -> float:
        failed = self.transport_errors + sum(n for code, n in self.statuses.items() if code >= 500)
        return failed / max(1, self.requests)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("inf")

    @property
    def rss_growth_mib(self) -> float:
        """Median RSS of the last third minus that of the first third."""
        third = max(1, len(self.rss_mib) // 3)
        first, last = sorted(self.rss_mib[:third]), sorted(self.rss_mib[-third:])
        return last[len(last) // 2] - first[len(first) // 2]

    def summary(self, what: str, concurrency: int) -> str:
        return (
            f"{what}: {self.requests} requests in {self.seconds:.1f} s at concurrency {concurrency} "
            f"({self.requests / self.seconds:.0f}/s), p50 {1000 * self.quantile(0.5):.1f} ms, "
            f"p99 {1000 * self.quantile(0.99):.1f} ms, errors {100 * self.error_rate:.2f}%, "
            f"statuses {dict(self.statuses)}, "
            f"RSS {self.rss_mib[0]:.0f} -> {self.rss_mib[-1]:.0f} MiB (growth {self.rss_growth_mib:+.1f} MiB), "
            f"load average {os.getloadavg()[0]:.1f}"
        )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def sustain(base_url: str, request: Request, *, concurrency: int, seconds: float, pid: int) -> LoadResult:
    result = LoadResult(seconds=seconds)
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits, trust_env=False) as client:

        async def worker(index: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    response = await request(client, index * 1_000_000 + n)
                except httpx.TransportError:
                    result.transport_errors += 1
                else:
                    result.latencies.append(time.perf_counter() - started)
                    result.statuses[response.status_code] += 1
                n += 1

        async def sample_memory() -> None:
            while time.monotonic() < deadline:
                result.rss_mib.append(rss_mib(pid))
                await asyncio.sleep(min(1.0, seconds / 10))

        await asyncio.gather(sample_memory(), *(worker(i) for i in range(concurrency)))
    result.rss_mib.append(rss_mib(pid))
    return result
