"""Collecting a step's groups from the real stream when Redis delivered a read whose reply was lost."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import redis

from rlfleet.sample_stream import SampleStream, StreamEntry
from rlfleet.v1.samples_pb2 import Sample, SampleGroup
from rlfleet_trainer.run_loop import collect_groups

CONSUMER = "trainer-0"


class LosesFirstReply(SampleStream):
    """The first read is done by Redis but its reply never arrives, as when the client retries a read
    after the connection broke: the entries are pending on the consumer, never seen by it."""

    lost: list[str]

    def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[StreamEntry]:
        if not hasattr(self, "lost"):
            self.lost = [e.entry_id for e in super().read(consumer, count, block_ms)]
        return super().read(consumer, count, block_ms)


def group(run_id: str, i: int) -> SampleGroup:
    sample = Sample(
        sample_id=f"{i}-0", prompt_token_ids=[5], response_token_ids=[6], rollout_logprobs=[-0.5], loss_mask=[1]
    )
    return SampleGroup(group_id=f"{run_id}/0/{i}", run_id=run_id, samples=[sample])


def run_on(stream: SampleStream) -> Any:
    return SimpleNamespace(run_id="run", stream=stream, cursor="0", stop=threading.Event(), checkpoint_wanted=False)


def test_entries_whose_reply_was_lost_are_trained_first_and_none_is_skipped(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    stream = LosesFirstReply(redis_client, "run1", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run1", i)) for i in range(6)]
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=100)
    run = run_on(stream)

    first = collect_groups(run, settings, 3, checkpoints=None)  # type: ignore[arg-type]
    assert stream.lost == ids[:3]
    assert [e.entry_id for e in first] == ids[:3]
    second = collect_groups(run, settings, 3, checkpoints=None)  # type: ignore[arg-type]
    assert [e.entry_id for e in second] == ids[3:]


def test_a_step_without_lost_replies_reads_as_before(redis_client: redis.Redis, redis_prefix: str) -> None:
    stream = SampleStream(redis_client, "run2", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run2", i)) for i in range(4)]
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=100)
    run = run_on(stream)
    assert [e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] == ids[:2]  # type: ignore[arg-type]
    assert [e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] == ids[2:]  # type: ignore[arg-type]
    assert run.cursor == ids[3]
