"""Waiting out a Redis that stays unavailable, for as long as the run is not told to stop.

A run that waits for groups, or commits a checkpoint, loses nothing by waiting: whether it ends is the
orchestrator's to say (a StopRun), and the orchestrator's own reads and writes wait Redis out too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from rlfleet.sample_stream import redis_unavailable
from rlfleet_trainer.active_run import ActiveRun

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Between calls to a Redis that stays unavailable past its client's own retries (about 30 s each call).
REDIS_WAIT_S = 5.0


def waiting_out_redis(run: ActiveRun, call: Callable[[], T]) -> T | None:
    """`call()`'s answer, asked again every REDIS_WAIT_S while Redis stays unreachable or refuses writes past its
    client's own retries (`call` must be safe to repeat); None once the run is told to stop meanwhile."""
    run_id = run.run_id
    since: float | None = None
    while True:
        try:
            answer = call()
        except redis.RedisError as exc:
            if not redis_unavailable(exc):
                raise
            if since is None:
                since = time.monotonic()
                logger.warning(
                    "run %s: Redis is unavailable (%s: %s); the run waits for it",
                    run_id,
                    type(exc).__name__,
                    exc,
                    extra={"run_id": run_id},
                )
            if run.stop.wait(REDIS_WAIT_S):
                return None
            continue
        if since is not None:
            logger.info(
                "run %s: Redis answers again after %.0f s",
                run_id,
                time.monotonic() - since,
                extra={"run_id": run_id},
            )
        return answer
