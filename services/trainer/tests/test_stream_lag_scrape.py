"""What a /metrics scrape asks Redis for rlfleet_trainer_stream_lag_groups. It subtracted the run's lost groups by
reading the whole dead-letter stream, every group's payload with it, and asking SISMEMBER once per dead letter:
3000 dead letters of 8 x 1.5k-token groups (157 MB) took 0.59 s a scrape, and more would pass the scrape's 1 s
bound and leave the gauge NaN exactly while a producer bug fills the dead letters. The lost groups are now counted
from a hash kept when entries are moved aside: a few small commands, whatever the dead letters hold."""

from __future__ import annotations

import os
from typing import Any

import redis

from rlfleet.sample_stream import SampleStream
from rlfleet.v1.samples_pb2 import Sample, SampleGroup
from rlfleet_trainer.metrics import TrainerMetrics

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CONSUMER = "trainer-0"
TOKENS = 1500


class CommandLog(redis.Redis):
    """A client that notes every command it sends, with its arguments (a long bytes one as "<bytes>")."""

    def __init__(self, url: str) -> None:
        super().__init__(connection_pool=redis.ConnectionPool.from_url(url, socket_timeout=1.0))
        self.commands: list[tuple[str, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(tuple(_shown(a) for a in args))
        return super().execute_command(*args, **options)


def _shown(arg: Any) -> str:
    if isinstance(arg, bytes):
        return arg.decode(errors="replace") if len(arg) < 64 else "<bytes>"
    return str(arg)


def group(run_id: str, i: int, token: int = 6) -> SampleGroup:
    """A group of 8 samples of TOKENS tokens (about 100 kB), as a long rollout makes them."""
    sample = Sample(
        prompt_token_ids=[5] * TOKENS,
        response_token_ids=[token] * TOKENS,
        rollout_logprobs=[-0.5] * TOKENS,
        loss_mask=[1] * TOKENS,
    )
    return SampleGroup(group_id=f"{run_id}/0/{i}", run_id=run_id, samples=[sample] * 8)


def test_a_scrape_counts_the_lost_groups_without_reading_the_dead_letters(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    stream = SampleStream(redis_client, "lag", prefix=redis_prefix, vocab_size=10)
    stream.ensure_consumer_group()
    for i in range(3):
        stream.append(group("lag", i))
    for i in range(3, 23):
        stream.append(group("lag", i, token=50))  # past the model's vocabulary: appended, then set aside
    redis_client.xadd(stream.key, {"group_id": "junk", "group": b"\xff\xff not protobuf"})  # another writer's
    assert len(stream.read(CONSUMER, 100)) == 3
    assert stream.dead_letter_count() == 21

    log = CommandLog(REDIS_URL)
    metrics = TrainerMetrics()
    metrics.watch_stream_lag(log, redis_prefix, lambda: ("lag", 1))
    # 23 appended, 1 trained, 20 of the run's own set aside: the 2 delivered groups not trained yet.
    assert metrics.registry.get_sample_value("rlfleet_trainer_stream_lag_groups") == 2
    dead_reads = [c for c in log.commands if c[0] == "XRANGE" and c[1] == stream.dead_key]
    assert all("COUNT" in c for c in dead_reads), log.commands  # at most the oldest dead letter, never all of them
    assert not [c for c in log.commands if c[0] == "SISMEMBER"], log.commands
    assert len(log.commands) <= 5, log.commands
    log.close()
