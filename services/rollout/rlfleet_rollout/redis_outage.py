"""Waiting out Redis being unavailable to the orchestrator, without ending it.

Redis is unavailable when it is unreachable for longer than its client's retries (`REDIS_RETRY_BUDGET_S`,
rlfleet.sample_stream, which covers a restart: ConnectionError or TimeoutError then), or when it answers but
refuses writes: full at its maxmemory (OOM), a read-only replica (READONLY, after a failover), or unable to persist
(MISCONF: a failed snapshot or AOF write stops writes). The client does not retry a refusal, and none is a fault of
the orchestrator's: each lasts until an operator (or a failover) ends it. The run queue cannot pick a run and a
finished run cannot be recorded meanwhile, and neither may end the process (its records are what the run resumes
from): they wait here, each attempt bounded by the client's timeouts and retries, until Redis serves them or the
orchestrator shuts down. Which errors those are is rlfleet.sample_stream's to say (`redis_unavailable`,
`redis_refusal`): the trainer answers them the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

from rlfleet.sample_stream import redis_refusal, redis_unavailable
from rlfleet_rollout.metrics import RolloutMetrics

logger = logging.getLogger(__name__)

_FIRST_WAIT_S, _MAX_WAIT_S = 1.0, 30.0

T = TypeVar("T")


async def until_redis_answers(
    call: Callable[[], Awaitable[T]], what: str, metrics: RolloutMetrics, *, first_wait_s: float = _FIRST_WAIT_S
) -> T:
    """`call()`'s result, calling it again with exponential backoff for as long as Redis is unavailable.

    `what` names the waiter in logs and in the `rlfleet_rollout_redis_outage_waits` metric; any
    other error is raised at once.
    """
    wait = first_wait_s
    while True:
        try:
            return await call()
        except redis.RedisError as exc:
            if not redis_unavailable(exc):
                raise
            metrics.redis_outage_waits.labels(waiter=what).inc()
            logger.warning(
                "%s: Redis is unavailable (%s); trying again in %.0fs", what, redis_refusal(exc) or exc, wait
            )
            await asyncio.sleep(wait)
            wait = min(wait * 2, _MAX_WAIT_S)
