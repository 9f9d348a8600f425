"""Waiting out a Redis outage longer than its client's retries, without ending the orchestrator.

The Redis clients retry a lost connection for `REDIS_RETRY_BUDGET_S` (rlfleet.sample_stream), which
covers a restart. A longer outage reaches the orchestrator as ConnectionError or TimeoutError. The
run queue cannot pick a run and a finished run cannot be recorded without Redis, and neither may
end the process (its records are what the run resumes from): they wait here, each attempt bounded
by the client's timeouts and retries, until Redis answers or the orchestrator shuts down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlfleet.sample_stream import REDIS_RETRY_ERRORS
from rlfleet_rollout.metrics import RolloutMetrics

logger = logging.getLogger(__name__)

_FIRST_WAIT_S, _MAX_WAIT_S = 1.0, 30.0

T = TypeVar("T")


async def until_redis_answers(
    call: Callable[[], Awaitable[T]], what: str, metrics: RolloutMetrics, *, first_wait_s: float = _FIRST_WAIT_S
) -> T:
    """`call()`'s result, calling it again with exponential backoff for as long as Redis is unreachable.

    `what` names the waiter in logs and in the `rlfleet_rollout_redis_outage_waits` metric; any
    other error is raised at once.
    """
    wait = first_wait_s
    while True:
        try:
            return await call()
        except REDIS_RETRY_ERRORS as exc:
            metrics.redis_outage_waits.labels(waiter=what).inc()
            logger.warning("%s: Redis is unreachable (%s); trying again in %.0fs", what, exc, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, _MAX_WAIT_S)
