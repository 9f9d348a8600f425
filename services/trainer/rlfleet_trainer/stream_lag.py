"""rlfleet_trainer_stream_lag_groups: the active run's backlog, read from Redis when /metrics is scraped.

Set after each step, the gauge was sampled at its lowest (right after the step took its groups), never moved while
the trainer waited, and kept its last value after the run ended. Read at scrape time it is the backlog as Redis
holds it then: groups appended to the run's stream (its id set) less those trained and the run's own groups set
aside as dead letters. Consumer-group lag + pending would not do: the trainer acknowledges only what a checkpoint
covers, so pending entries include groups already trained. No active run: NaN, the trainer's "none". A scrape
asks Redis on a client of its own, with short timeouts and no retries, so a Redis down or slow makes the value
NaN (logged once in a while) instead of holding /metrics up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlfleet.sample_stream import SampleStream

logger = logging.getLogger(__name__)

NAME = "rlfleet_trainer_stream_lag_groups"
HELP = (
    "groups appended to the active run's stream and not yet trained on (undelivered, or delivered and not yet "
    "trained), without the ones set aside; NaN when no run trains or Redis did not answer"
)
SCRAPE_REDIS_TIMEOUT_S = 1.0
"""Bound on each Redis command of a scrape (a few commands per scrape, well within Prometheus' 10 s timeout)."""
ERROR_LOG_EVERY_S = 300.0


def stream_lag(stream: SampleStream, groups_trained: int) -> int:
    """Groups appended to `stream` and not trained yet, of a run that has trained `groups_trained`. Of the dead
    letters only the run's own groups were counted as appended (not another writer's entries), each once (a
    move retried after a lost reply writes its dead letter twice). Counted without reading the dead letters'
    payloads: a run with thousands of them would move hundreds of MB per scrape."""
    lost = stream.lost_group_count()
    return max(0, stream.appended_count() - groups_trained - lost)


def scrape_client(url: str, timeout_s: float = SCRAPE_REDIS_TIMEOUT_S) -> redis.Redis:
    """A client for scrapes: each command bounded by `timeout_s`, never retried (the next scrape asks again)."""
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


class StreamLagCollector(Collector):
    def __init__(self, client: redis.Redis, prefix: str, active: Callable[[], tuple[str, int] | None]) -> None:
        """`client`: a scrape client (`scrape_client`); `active`: the run being trained, as (run id, groups
        trained), or None."""
        self.client = client
        self.prefix = prefix
        self.active = active
        self._last_error_log = -math.inf

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(NAME, HELP)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(NAME, HELP, value=self._read())

    def _read(self) -> float:
        run = self.active()
        if run is None:
            return math.nan
        run_id, groups_trained = run
        try:
            return float(stream_lag(SampleStream(self.client, run_id, prefix=self.prefix), groups_trained))
        except redis.RedisError as exc:
            now = time.monotonic()
            if now - self._last_error_log >= ERROR_LOG_EVERY_S:
                self._last_error_log = now
                logger.warning("run %s: stream lag not read (exported as NaN): %s", run_id, exc)
            return math.nan
