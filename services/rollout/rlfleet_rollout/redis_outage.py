"""Waiting out Redis being unavailable to the orchestrator, without ending it.

Redis is unavailable when it is unreachable for longer than its client's retries (`REDIS_RETRY_BUDGET_S`,
rlfleet.sample_stream, which covers a restart: ConnectionError or TimeoutError then), or when it answers but
refuses writes: full at its maxmemory (OOM), a read-only replica (READONLY, after a failover), or unable to persist
(MISCONF: a failed snapshot or AOF write stops writes). The client does not retry a refusal, and none is a fault of
the orchestrator's: each lasts until an operator (or a failover) ends it. The run queue cannot pick a run and a
finished run cannot be recorded meanwhile, and neither may end the process (its records are what the run resumes
from): they wait here, each attempt bounded by the client's timeouts and retries, until Redis serves them or the
orchestrator shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

from rlfleet.sample_stream import REDIS_RETRY_ERRORS
from rlfleet_rollout.metrics import RolloutMetrics

logger = logging.getLogger(__name__)

_FIRST_WAIT_S, _MAX_WAIT_S = 1.0, 30.0
# redis-py has no class for MISCONF; inside a transaction it prefixes the reply with the command that met it
# ("Command # 1 (SET ...) of pipeline caused error: ('MISCONF ...',)").
_MISCONF = re.compile(r"""(?:^|of pipeline caused error: \(?["']?)MISCONF """)

T = TypeVar("T")


def refusal(exc: BaseException) -> str | None:
    """Why Redis refused a write, when `exc` is Redis refusing it for a state of its own (for logs and callers: the
    error's own text may quote the command, a run's serialized record); None for any other error."""
    if isinstance(exc, redis.OutOfMemoryError):
        return "Redis is full: its used memory is over its maxmemory (OOM)"
    if isinstance(exc, redis.ReadOnlyError):
        return "Redis is a read-only replica (READONLY)"
    if isinstance(exc, redis.ResponseError) and _MISCONF.search(str(exc)):
        return "Redis cannot persist to disk, and stops writes until it can (MISCONF; its log says why)"
    return None


def redis_unavailable(exc: BaseException) -> bool:
    """Whether `exc` says Redis cannot serve the orchestrator for now: unreachable, or refusing writes."""
    return isinstance(exc, REDIS_RETRY_ERRORS) or refusal(exc) is not None


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
            logger.warning("%s: Redis is unavailable (%s); trying again in %.0fs", what, refusal(exc) or exc, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, _MAX_WAIT_S)
