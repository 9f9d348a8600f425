"""Shared fixtures of the reward hub's tests.

This directory goes on sys.path so that `reward_test_functions` has a plain module name: worker
processes import test functions by that name, which pytest's importlib mode would not give them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from reward_test_functions import TEST_FUNCTIONS  # noqa: E402

from rlfleet_reward.http_retry import close_clients  # noqa: E402
from rlfleet_reward.metrics import RewardMetrics  # noqa: E402
from rlfleet_reward.registry import Registry  # noqa: E402
from rlfleet_reward.sandbox_memory import MemoryBudget  # noqa: E402
from rlfleet_reward.scoring import Scorer, ScoringLimits  # noqa: E402
from rlfleet_reward.worker_pool import WorkerPool  # noqa: E402

T = TypeVar("T")


def registry_with_test_functions() -> Registry:
    return Registry.from_entry_points(extra=TEST_FUNCTIONS)


def _with_scorer(
    body: Callable[[Scorer], Awaitable[T]],
    workers: int = 2,
    max_batch_size: int = 64,
    default_timeout_seconds: float = 5.0,
    max_pending_jobs: int = 16384,
    admission_wait_seconds: float = 5.0,
    memory_budget: MemoryBudget | None = None,
) -> T:

    async def main() -> T:
        registry = registry_with_test_functions()
        pool = WorkerPool(registry.pool_functions(), workers, memory_budget=memory_budget)
        pool.start()
        metrics = RewardMetrics()
        metrics.watch_pool(pool)
        try:
            limits = ScoringLimits(
                default_timeout_seconds,
                30.0,
                max_batch_size,
                max_pending_jobs=max_pending_jobs,
                admission_wait_seconds=admission_wait_seconds,
            )
            return await body(Scorer(registry, pool, limits, metrics))
        finally:
            await pool.close()
            await close_clients()

    return asyncio.run(main())


@pytest.fixture
def with_scorer() -> Callable[..., Any]:
    """`with_scorer(body, workers=2, ...)` runs `body(scorer)` over a real worker pool, closed afterwards."""
    return _with_scorer
