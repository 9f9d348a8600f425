"""Which orchestrator drives a run: a lease in Redis that its driver renews, so that two orchestrators on one
Redis never drive a run together, and a run whose driver died is taken over once the lease runs out.

Key `run:<id>:driver` (under the prefix) holds the driver's token (host, pid and a random part) with an expiry
of `ttl_s`. The run queue takes it before it drives a run, `keep` renews it every quarter of `ttl_s` while the
run is driven, and the queue deletes it when it stops driving the run (the run ended, or the orchestrator shuts
down). A driver that died leaves it to run out. Taking, renewing and releasing each check the token in one
script, so a lease another orchestrator holds is never extended or deleted.

While Redis is away nobody renews or takes a lease; one that ran out meanwhile goes to whichever orchestrator
asks first once Redis is back. Its driver does not wait to hear that: it counts the lease's time itself, on its
own monotonic clock from when it sent the last renewal Redis confirmed (Redis starts the expiry later, on its
receipt), and stops driving the run once all but a tenth of that time has passed unrenewed, however long Redis
takes to answer (each renewal is bounded by the time left): as at a shutdown, the run stays RUNNING, for whichever
orchestrator takes its lease next, this one included. Unbounded, a renewal waited out the Redis client's 30 s of
retries while another orchestrator took the run over after the lease's 15 s, and the first then wrote the run
FAILED ("Redis was unreachable") under the one driving it. No two hosts' clocks are compared: only how long the
lease lasts, as Redis and the driver each measure it. A driver that stops late all the same (paused past the lease's
time, or its lease key lost by Redis) writes nothing of the run then: each of its writes of the run's record checks
the lease's token in its own transaction (`fence`, run_fence.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.run_fence import RunFence

logger = logging.getLogger(__name__)

# The driver stops driving once this fraction of the lease's time is left unrenewed, so that its run's task has
# ended before the lease runs out in Redis and another orchestrator may take the run over.
_STOP_WITH_LEFT = 0.1

# Takes the lease when nobody holds it, extends it when the caller does; 0 when another orchestrator holds it.
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_key(prefix: str, run_id: str) -> str:
    """The key of the lease of `run_id`: it exists while an orchestrator drives the run."""
    return f"{prefix}run:{run_id}:driver"


def instance_token() -> str:
    """This orchestrator among others, in logs: where it runs, and a random part that a restart changes."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


class RunLease:
    def __init__(self, client: aioredis.Redis, prefix: str, *, ttl_s: float, token: str | None = None) -> None:
        assert ttl_s > 0, ttl_s
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.token = token or instance_token()
        self._held_until: dict[str, float] = {}
        """Per run held: until when (monotonic) its lease is this orchestrator's for sure, by the last renewal."""

    def key(self, run_id: str) -> str:
        return lease_key(self.prefix, run_id)

    def fence(self, run_id: str) -> RunFence:
        """The fence the writes of `run_id`'s driver here check: this orchestrator's token in the run's lease."""
        return RunFence(run_id, self.key(run_id), self.token)

    async def hold(self, run_id: str) -> bool:
        """Takes the lease of `run_id`, or extends it when this orchestrator holds it; False while another does."""
        sent = time.monotonic()
        held = bool(await self.client.eval(_HOLD, 1, self.key(run_id), self.token, int(self.ttl_s * 1000)))
        if held:
            self._held_until[run_id] = sent + self.ttl_s
        return held

    def held_for_s(self, run_id: str) -> float:
        """Seconds for which the lease of `run_id` is this orchestrator's for sure (by its last renewal), or <= 0."""
        return self._held_until.get(run_id, -math.inf) - time.monotonic()

    def _stop_in_s(self, run_id: str) -> float:
        """Seconds until the driver of `run_id` stops driving it unless its lease is renewed meanwhile."""
        return self.held_for_s(run_id) - _STOP_WITH_LEFT * self.ttl_s

    async def release(self, run_id: str) -> None:
        """Deletes the lease of `run_id` if this orchestrator holds it."""
        self._held_until.pop(run_id, None)
        await self.client.eval(_RELEASE, 1, self.key(run_id), self.token)

    async def others(self, run_ids: Sequence[str]) -> dict[str, str]:
        """The runs among `run_ids` whose lease another orchestrator holds, with that one's token."""
        if not run_ids:
            return {}
        raw = await self.client.mget([self.key(run_id) for run_id in run_ids])
        tokens = [t.decode() if isinstance(t, bytes) else t for t in raw]
        return {run_id: t for run_id, t in zip(run_ids, tokens, strict=True) if t is not None and t != self.token}

    async def expires_in_s(self, run_id: str) -> float | None:
        """Seconds until the lease of `run_id` runs out unless renewed; None when nobody holds it."""
        left_ms = await self.client.pttl(self.key(run_id))
        return left_ms / 1000 if left_ms >= 0 else None

    async def keep(self, run_id: str, driving: asyncio.Task[None]) -> None:
        """Renews the lease of `run_id` (taken with `hold`) every quarter of its time until cancelled. If another
        orchestrator holds it now, or a tenth of its time is left unrenewed (Redis did not answer), `driving` is
        cancelled and this returns. Any other failure (not Redis's: a fault of ours) ends it with that exception,
        `driving` untouched: whoever runs both stops `driving` then, as the run queue does."""
        log = {"run_id": run_id}
        while True:
            # Renewed every quarter of its time, and the driving stopped when only a tenth of it is left unrenewed.
            await asyncio.sleep(min(self.ttl_s / 4, max(0.0, self._stop_in_s(run_id))))
            left_s = self._stop_in_s(run_id)
            try:
                if left_s <= 0:
                    raise TimeoutError
                async with asyncio.timeout(left_s):
                    held = await self.hold(run_id)
            except TimeoutError:
                logger.error(
                    "run %s: its lease was not renewed for %.1fs of its %.0fs (Redis did not answer); this one stops "
                    "driving it, which stays RUNNING for the next orchestrator to take its lease",
                    run_id,
                    (1 - _STOP_WITH_LEFT) * self.ttl_s,
                    self.ttl_s,
                    extra=log,
                )
                await cancel_and_wait(driving)
                return
            except RedisError as exc:  # tried again while the lease lasts
                logger.warning("run %s: cannot renew its lease: %s", run_id, exc, extra=log)
                continue
            if not held:
                try:
                    async with asyncio.timeout(self.ttl_s):
                        holder = (await self.others([run_id])).get(run_id, "another orchestrator")
                except (RedisError, TimeoutError):
                    holder = "another orchestrator"
                logger.error(
                    "orchestrator %s holds the lease of run %s now (this one's ran out); this one stops driving it",
                    holder,
                    run_id,
                    extra=log,
                )
                await cancel_and_wait(driving)
                return
