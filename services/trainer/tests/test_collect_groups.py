"""The trainer's side of the real stream: collecting a step's groups (when Redis delivered a read whose reply
was lost, or another consumer left groups behind), the checkpoint commit that acknowledges and trims them, and
the backlog /metrics reports (stream_lag.py)."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from prometheus_client import generate_latest

from rlfleet.errors import Conflict
from rlfleet.sample_stream import SampleStream, StreamEntry
from rlfleet.v1.samples_pb2 import Sample, SampleGroup
from rlfleet_trainer.checkpoint_commit import CheckpointCommitter
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.run_loop import collect_groups
from rlfleet_trainer.run_state import RunRecord, RunStateStore
from rlfleet_trainer.stream_lag import scrape_client

CONSUMER = "trainer-0"

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


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
    return SimpleNamespace(
        run_id="run",
        stream=stream,
        cursor="0",
        uncommitted=[],
        claimed_behind=[],
        stop=threading.Event(),
        checkpoint_wanted=False,
    )


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


def test_a_lost_reply_holding_an_untrainable_entry_leaves_the_step_whole(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """The pending entries read in place of a lost reply fell one short when one of them went to the dead letters
    (here another run's group), and the run loop took the short step for a stop: the run ended STOPPED, silently."""

    class LosesFirstRawReply(SampleStream):
        """Redis delivers the first read, whose reply (never decoded) is lost."""

        lost: list[str]

        def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[StreamEntry]:
            if not hasattr(self, "lost"):
                reply = cast(Any, self.client.xreadgroup(self.consumer_group, consumer, {self.key: ">"}, count=count))
                self.lost = [entry_id.decode() for entry_id, _ in reply[0][1]]
            return super().read(consumer, count, block_ms)

    stream = LosesFirstRawReply(redis_client, "run5", prefix=redis_prefix)
    stream.ensure_consumer_group()
    redis_client.xadd(stream.key, {"group_id": "other/0/0", "group": group("other", 0).SerializeToString()})
    ids = [stream.append(group("run5", i)) for i in range(6)]
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=100)
    run = run_on(stream)

    first = collect_groups(run, settings, 3, checkpoints=None)  # type: ignore[arg-type]
    assert len(stream.lost) == 3 and stream.lost[1:] == ids[:2]
    assert [e.entry_id for e in first] == ids[:3] and not run.stop.is_set()
    assert [reason[:40] for _, reason in stream.dead_letters()] == ["untrainable: SampleGroup other/0/0 belon"]
    second = collect_groups(run, settings, 3, checkpoints=None)  # type: ignore[arg-type]
    assert [e.entry_id for e in second] == ids[3:]


def test_a_lost_reply_before_the_stream_goes_quiet_is_taken(redis_client: redis.Redis, redis_prefix: str) -> None:
    """The lost reply held the step's last groups and nothing came after it: the entries it delivered were found
    only once a later read returned some."""
    stream = LosesFirstReply(redis_client, "run6", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run6", i)) for i in range(2)]
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=100)
    run = run_on(stream)
    done = threading.Timer(10, run.stop.set)  # a bound on the wait, were the entries never found
    done.start()
    try:
        taken = collect_groups(run, settings, 2, checkpoints=None)  # type: ignore[arg-type]
    finally:
        done.cancel()
    assert stream.lost == ids and [e.entry_id for e in taken] == ids and not run.stop.is_set()


def test_a_step_without_lost_replies_reads_as_before(redis_client: redis.Redis, redis_prefix: str) -> None:
    stream = SampleStream(redis_client, "run2", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run2", i)) for i in range(4)]
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=100)
    run = run_on(stream)
    assert [e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] == ids[:2]  # type: ignore[arg-type]
    assert [e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] == ids[2:]  # type: ignore[arg-type]
    assert run.cursor == ids[3]


def test_groups_another_consumer_left_are_trained_before_new_ones(redis_client: redis.Redis, redis_prefix: str) -> None:
    """A trainer resumed under a new consumer name read new groups while the old name's were not yet idle
    enough to claim: later steps' groups were trained first, and the earlier ones in other steps."""
    stream = SampleStream(redis_client, "run3", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run3", i)) for i in range(6)]
    stream.read("trainer-old", 2)  # the trainer before its restart took steps 0's groups and died
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=300, read_block_ms=50)
    run = run_on(stream)
    assert [e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] == ids[:2]  # type: ignore[arg-type]
    assert [e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] == ids[2:4]  # type: ignore[arg-type]


def test_groups_held_elsewhere_older_than_the_own_ones_are_trained_first(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """A trainer back under a name it ran under before took its own pending groups first, so step 0's groups, held
    by the name it ran under in between, were trained in a later step than newer ones (past max_staleness)."""
    stream = SampleStream(redis_client, "run4", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run4", i)) for i in range(6)]
    stream.read(CONSUMER, 4)  # steps 0 and 1, then the trainer died before a checkpoint
    time.sleep(0.05)
    assert [e.entry_id for e in stream.claim_stale("trainer-between", 10, 2)] == ids[:2]  # step 0 again; died
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=200, read_block_ms=50)
    run = run_on(stream)
    steps = [[e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] for _ in range(3)]  # type: ignore[arg-type]
    assert steps == [ids[:2], ids[2:4], ids[4:]]


def test_groups_claimed_from_a_consumer_reading_beside_the_trainer_are_trained_though_behind_its_cursor(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """Two consumers read one run's stream at once (a trainer still running beside the one that replaced it, under
    another name): the other took groups 0 and 1 while this trainer took 2 and 3 and trained them. Claimed once the
    other had gone quiet, 0 and 1 lay behind the cursor, which the steps read after: pending on this trainer, never
    trained, until it restarted, and the stream untrimmed from them on. Its own groups 2 and 3, which the other had
    claimed in turn while they awaited their checkpoint, are not trained again."""
    stream = SampleStream(redis_client, "run7", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run7", i)) for i in range(8)]
    assert [e.entry_id for e in stream.read("trainer-other", 2)] == ids[:2]
    assert [e.entry_id for e in stream.read(CONSUMER, 2)] == ids[2:4]  # step 1, trained, not yet checkpointed
    run = run_on(stream)
    run.cursor, run.uncommitted = ids[3], ids[2:4]
    time.sleep(0.05)
    assert [e.entry_id for e in stream.claim_stale("trainer-other", 10)] == ids[2:4]
    time.sleep(0.05)
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=10, read_block_ms=50)
    done = threading.Timer(10, run.stop.set)  # a bound on the wait, were groups 0 and 1 never taken
    done.start()
    try:
        steps = [[e.entry_id for e in collect_groups(run, settings, 2, checkpoints=None)] for _ in range(3)]  # type: ignore[arg-type]
    finally:
        done.cancel()
    assert steps == [ids[:2], ids[4:6], ids[6:]]
    held = cast(list[dict[str, Any]], redis_client.xpending_range(stream.key, stream.consumer_group, "-", "+", 10))
    assert {row["consumer"] for row in held} == {CONSUMER.encode()} and len(held) == 8  # 2 and 3 await a checkpoint


class AwayFor(SampleStream):
    """Redis stays unreachable past the client's own retries for the first `outages` reads of new groups."""

    outages = 2

    def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[StreamEntry]:
        if self.outages:
            self.outages -= 1
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return super().read(consumer, count, block_ms)


def test_a_redis_outage_while_the_run_waits_for_groups_is_waited_out(
    redis_client: redis.Redis, redis_prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a read that failed past the client's 30 s of retries failed the run for good (FAILED), while the
    orchestrator, whose reads and writes wait Redis out, went on producing its groups."""
    monkeypatch.setattr("rlfleet_trainer.redis_wait.REDIS_WAIT_S", 0.05)
    stream = AwayFor(redis_client, "run5", prefix=redis_prefix)
    stream.ensure_consumer_group()
    ids = [stream.append(group("run5", i)) for i in range(2)]
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=50)
    with caplog.at_level(logging.INFO, logger="rlfleet_trainer.redis_wait"):
        entries = collect_groups(run_on(stream), settings, 2, checkpoints=None)  # type: ignore[arg-type]
    assert [e.entry_id for e in entries] == ids and stream.outages == 0
    assert "run run: Redis is unavailable (ConnectionError:" in caplog.text and "Redis answers again" in caplog.text

    stream.outages = 10**6  # away for good: a stop still ends the wait, with the groups delivered before
    run = run_on(stream)
    threading.Timer(0.3, run.stop.set).start()
    started = time.monotonic()
    stopped = collect_groups(run, settings, 3, checkpoints=None)  # type: ignore[arg-type]
    assert [e.entry_id for e in stopped] == ids and time.monotonic() - started < 5


@pytest.mark.parametrize("keep", [False, True])
def test_a_commit_acknowledges_and_trims_what_its_checkpoint_covers(
    redis_client: redis.Redis, redis_prefix: str, keep: bool
) -> None:
    stream = SampleStream(redis_client, "run1", prefix=redis_prefix)
    stream.ensure_consumer_group()
    for i in range(5):
        stream.append(group("run1", i))
    taken = stream.read("trainer-0", 3)
    store = RunStateStore(redis_client, redis_prefix, keep_trained_groups=keep)
    store.commit("run1", RunRecord(step=1, checkpoint_path="/c/1", groups_trained=2), stream, [taken[0].entry_id])
    assert store.load("run1") == RunRecord(step=1, checkpoint_path="/c/1", groups_trained=2)
    assert stream.pending_count() == 2
    assert stream.length() == (5 if keep else 4)  # trained but not yet covered by a checkpoint: kept
    store.commit(
        "run1",
        RunRecord(step=2, checkpoint_path="/c/2", groups_trained=3),
        stream,
        [e.entry_id for e in taken],
        replaces="/c/1",
    )
    assert stream.pending_count() == 0
    assert [e.group.group_id for e in stream.entries()] == [f"run1/0/{i}" for i in (range(5) if keep else (3, 4))]
    assert stream.appended_count() == 5


def test_a_commit_over_a_record_redis_rolled_back_fails_and_one_repeated_is_taken(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """Redis restarted without its last writes (AOF fsync'd each second, a host crash; a failover): the record went
    back to an earlier checkpoint, the groups acknowledged since were pending again, and the trainer trained on over
    it, acknowledging nothing of them: they blocked trimming for the rest of the run, and were trained twice after
    the next restart. The commit now finds the record is not the one it follows."""
    stream = SampleStream(redis_client, "run7", prefix=redis_prefix)
    stream.ensure_consumer_group()
    for i in range(4):
        stream.append(group("run7", i))
    taken = [e.entry_id for e in stream.read(CONSUMER, 4)]
    store = RunStateStore(redis_client, redis_prefix)
    first = RunRecord(step=1, checkpoint_path="/c/1", groups_trained=2)
    store.commit("run7", first, stream, taken[:2])
    store.commit("run7", first, stream, taken[:2])  # the same commit again (its reply was lost): done already
    store.commit(
        "run7", RunRecord(step=2, checkpoint_path="/c/2", groups_trained=4), stream, taken[2:], replaces="/c/1"
    )
    redis_client.hset(store.key("run7"), mapping={"step": 1, "checkpoint_path": "/c/1", "groups_trained": 2})
    with pytest.raises(Conflict, match=r"Redis lost writes .* names checkpoint '/c/1', not '/c/2'"):
        store.commit("run7", RunRecord(step=3, checkpoint_path="/c/3", groups_trained=4), stream, [], replaces="/c/2")
    assert store.load("run7") == first


@pytest.mark.parametrize("fields", [{"checkpoint_path": "/c/1"}, {"checkpoint_path": "/c/1", "step": "two"}])
def test_a_record_the_trainer_did_not_write_is_refused_naming_it(
    redis_client: redis.Redis, redis_prefix: str, fields: dict[str, str | int]
) -> None:
    store = RunStateStore(redis_client, redis_prefix)
    record: dict[str, str | int] = {"weight_version": 1, "groups_trained": 2, **fields}
    redis_client.hset(store.key("odd"), mapping=record)  # type: ignore[arg-type]  # redis types its keys invariantly
    with pytest.raises(Conflict, match=rf"record of run odd \({store.key('odd')}\) is not one it wrote"):
        store.load("odd")


def test_the_wait_for_groups_calls_its_hook_between_reads(redis_client: redis.Redis, redis_prefix: str) -> None:
    """The hook (the fleet's version check) runs while the trainer waits, not only between steps."""
    stream = SampleStream(redis_client, "run4", prefix=redis_prefix)
    stream.ensure_consumer_group()
    settings = SimpleNamespace(consumer=CONSUMER, claim_idle_ms=60_000, read_block_ms=50)
    run = run_on(stream)
    calls: list[object] = []

    def while_waiting(waiting_run: object) -> None:
        calls.append(waiting_run)
        if len(calls) == 3:
            stream.append(group("run4", 0))

    entries = collect_groups(run, settings, 1, None, while_waiting)  # type: ignore[arg-type]
    assert [e.group.group_id for e in entries] == ["run4/0/0"]
    assert len(calls) >= 3 and all(c is run for c in calls)


def test_the_stream_lag_leaves_out_only_the_runs_own_groups_set_aside(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """rlfleet_trainer_stream_lag_groups: groups appended and not yet trained. Only the run's own groups were
    counted as appended, so only they leave the backlog when set aside: subtracting every dead letter (another
    writer's entries, one written twice by a retried move) hid groups still waiting to be trained."""
    stream = SampleStream(redis_client, "lag", prefix=redis_prefix, vocab_size=10)
    stream.ensure_consumer_group()
    for i in range(5):
        stream.append(group("lag", i))
    own_bad = group("lag", 5)
    own_bad.samples[0].response_token_ids[0] = 50  # past the model's vocabulary: appended, then set aside
    bad_id = stream.append(own_bad)
    redis_client.xadd(stream.key, {"group_id": "other/0/0", "group": group("other", 0).SerializeToString()})
    redis_client.xadd(stream.key, {"group_id": "junk", "group": b"\xff\xff not protobuf"})
    assert len(stream.read(CONSUMER, 10)) == 5
    assert bad_id is not None
    stream._move_to_dead_letters(bad_id, {b"group_id": own_bad.group_id.encode()}, "again")  # a retried move
    assert stream.dead_letter_count() == 4

    metrics = TrainerMetrics()
    metrics.watch_stream_lag(scrape_client(REDIS_URL), redis_prefix, lambda: ("lag", 2))
    # 6 appended, 2 trained, 1 of the run's own set aside: the 3 delivered groups not trained yet.
    assert metrics.registry.get_sample_value("rlfleet_trainer_stream_lag_groups") == 3


def test_the_stream_lag_is_none_without_a_run_and_when_redis_fails_a_scrape_still_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No run trains: NaN, the trainer's "none". Redis refusing the connection or never answering: NaN within the
    scrape client's timeout, /metrics answering with every other metric, and one warning for many scrapes."""
    idle = TrainerMetrics()
    idle.watch_stream_lag(scrape_client(REDIS_URL), "unused:", lambda: None)
    assert math.isnan(idle.registry.get_sample_value("rlfleet_trainer_stream_lag_groups") or 0.0)

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers a command
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        for url in ("redis://127.0.0.1:9/0", f"redis://127.0.0.1:{silent.getsockname()[1]}/0"):
            metrics = TrainerMetrics()
            metrics.watch_stream_lag(scrape_client(url, timeout_s=0.5), "unused:", lambda: ("lag", 0))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rlfleet_trainer.stream_lag"):
                started = time.monotonic()
                for _ in range(3):
                    exported = generate_latest(metrics.registry).decode()
                    assert "rlfleet_trainer_stream_lag_groups NaN" in exported
                    assert "rlfleet_trainer_step 0.0" in exported
                assert time.monotonic() - started < 3 * 2 * 0.5 + 1  # a bounded wait per scrape, no retries
            assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    finally:
        silent.close()


class CommitsAfter(RunStateStore):
    """Redis stays unreachable past the client's own retries for the first `outages` commits."""

    outages = 2

    def commit(
        self, run_id: str, record: RunRecord, stream: SampleStream, entry_ids: Sequence[str], *, replaces: str = ""
    ) -> None:
        if self.outages:
            self.outages -= 1
            raise redis.ConnectionError("Error 104 while writing to socket. Connection reset by peer.")
        super().commit(run_id, record, stream, entry_ids, replaces=replaces)


def test_a_redis_outage_while_a_checkpoint_is_committed_is_waited_out(
    redis_client: redis.Redis, redis_prefix: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before, the commit's failure past the client's retries failed the run for good (FAILED), though the same
    outage while it waited for groups was waited out; a stop still ends the wait, the checkpoint unrecorded."""
    monkeypatch.setattr("rlfleet_trainer.redis_wait.REDIS_WAIT_S", 0.05)
    stream = SampleStream(redis_client, "run6", prefix=redis_prefix)
    stream.ensure_consumer_group()
    stream.append(group("run6", 0))
    (taken,) = stream.read(CONSUMER, 1)
    store = CommitsAfter(redis_client, redis_prefix)
    updates: list[dict[str, object]] = []
    run = SimpleNamespace(
        run_id="run6",
        stream=stream,
        stop=threading.Event(),
        checkpoint_path="",
        checkpoint_step=0,
        last_entry_id="0",
        uncommitted=[taken.entry_id],
        checkpoints_root=tmp_path,
        ranks=SimpleNamespace(call=lambda _op, root, meta: Path(root) / f"step-{meta.step}"),
        update=lambda **fields: updates.append(fields),
    )
    committer = CheckpointCommitter(store, keep=2, metrics=TrainerMetrics())
    committer.commit(run, 1, 1)  # type: ignore[arg-type]
    recorded = store.load("run6")
    assert store.outages == 0 and recorded is not None and recorded.checkpoint_path == str(tmp_path / "step-1")
    assert stream.pending_count() == 0 and updates[-1]["checkpoint_step"] == 1

    store.outages, updates[:] = 10**6, []  # away for good: a stop ends the wait, and nothing is recorded
    run.checkpoint_path, run.uncommitted = str(tmp_path / "step-1"), []
    threading.Timer(0.3, run.stop.set).start()
    started = time.monotonic()
    committer.commit(run, 2, 1)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert store.load("run6") == recorded and updates == []
