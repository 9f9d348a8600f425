"""The sample stream against the real Redis: append once, read, ack, claim from a dead consumer."""

from __future__ import annotations

import time
from typing import cast

import pytest
import redis

from rlfleet.errors import InvalidInput
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus


def make_group(run_id: str, i: int, n: int = 2) -> SampleGroup:
    samples = [
        Sample(
            sample_id=f"{i}-{j}",
            index=j,
            prompt_token_ids=[5, 6, 7],
            response_token_ids=[8, 9],
            rollout_logprobs=[-0.5, -1.25],
            loss_mask=[1, 1],
            reward=float(j),
            reward_components={"arith_exact": float(j)},
            weight_versions=[3],
            status=SampleStatus.SAMPLE_STATUS_OK,
        )
        for j in range(n)
    ]
    return SampleGroup(
        group_id=f"{run_id}/0/{i}", run_id=run_id, prompt_id=str(i), label="82", samples=samples, weight=1.0
    )


@pytest.fixture
def stream(redis_client: redis.Redis, redis_prefix: str) -> SampleStream:
    s = SampleStream(redis_client, "run1", prefix=redis_prefix)
    s.ensure_consumer_group()
    return s


def test_round_trip_preserves_every_field(stream: SampleStream) -> None:
    group = make_group("run1", 0)
    entry_id = stream.append(group)
    assert entry_id
    [entry] = stream.read("trainer-0", count=10)
    assert entry.entry_id == entry_id
    assert entry.group == group
    assert list(entry.group.samples[0].rollout_logprobs) == [-0.5, -1.25]
    assert entry.group.samples[1].reward_components["arith_exact"] == 1.0


def test_same_group_id_is_appended_once(stream: SampleStream) -> None:
    assert stream.append(make_group("run1", 0))
    assert stream.append(make_group("run1", 0)) is None
    assert stream.length() == 1


def test_an_append_whose_lost_reply_is_retried_returns_its_entry(
    redis_losing_first_script_reply: redis.Redis, redis_prefix: str
) -> None:
    """The client retries an append whose connection dropped after Redis ran it; the retry found the group id known
    and the append said None, "appended before", so the orchestrator did not count a group that it had appended.
    A later append of the same group id is still refused."""
    stream = SampleStream(redis_losing_first_script_reply, "run1", prefix=redis_prefix)
    entry_id = stream.append(make_group("run1", 0))
    [entry] = stream.entries()
    assert entry_id == entry.entry_id
    assert stream.append(make_group("run1", 0)) is None
    assert stream.length() == stream.appended_count() == 1


def test_read_ack_and_pending(stream: SampleStream) -> None:
    for i in range(5):
        stream.append(make_group("run1", i))
    first = stream.read("c", count=3)
    assert [e.group.prompt_id for e in first] == ["0", "1", "2"]
    assert stream.pending_count() == 3
    assert stream.ack(e.entry_id for e in first) == 3
    rest = stream.read("c", count=10)
    assert [e.group.prompt_id for e in rest] == ["3", "4"]
    assert stream.read("c", count=10, block_ms=50) == []
    assert stream.pending_count() == 2


def test_trimming_removes_only_what_was_delivered_and_acknowledged(stream: SampleStream) -> None:
    """A run kept every group it ever trained on the stream, about 66 kB each, until Redis ran out of memory."""
    for i in range(6):
        stream.append(make_group("run1", i))
    delivered = stream.read("c", count=4)
    stream.ack([delivered[0].entry_id, delivered[2].entry_id])  # 1 and 3 stay pending, 4 and 5 undelivered
    stream.trim_acknowledged()
    assert [e.group.prompt_id for e in stream.entries()] == ["1", "2", "3", "4", "5"]
    stream.ack([delivered[1].entry_id, delivered[3].entry_id])
    stream.trim_acknowledged()
    assert [e.group.prompt_id for e in stream.entries()] == ["4", "5"]  # never delivered: kept
    assert [e.group.prompt_id for e in stream.read("c", count=10)] == ["4", "5"]
    stream.ack(e.entry_id for e in stream.read_own_pending("c", count=10))
    stream.trim_acknowledged()
    assert stream.length() == 0 and stream.appended_count() == 6
    assert stream.append(make_group("run1", 0)) is None  # still known: a retried append adds nothing


def test_a_stream_nobody_reads_is_not_trimmed(redis_client: redis.Redis, redis_prefix: str) -> None:
    unread = SampleStream(redis_client, "run2", prefix=redis_prefix)
    unread.trim_acknowledged()  # no stream yet
    unread.append(make_group("run2", 0))
    unread.trim_acknowledged()  # no consumer group yet
    assert unread.length() == 1


def test_restarted_consumer_sees_its_own_pending(stream: SampleStream) -> None:
    for i in range(3):
        stream.append(make_group("run1", i))
    delivered = stream.read("trainer-0", count=3)
    stream.ack([delivered[0].entry_id])
    again = stream.read_own_pending("trainer-0", count=10)
    assert [e.group.prompt_id for e in again] == ["1", "2"]


def test_dead_consumer_entries_are_claimed(stream: SampleStream) -> None:
    for i in range(4):
        stream.append(make_group("run1", i))
    stream.read("dead", count=4)
    assert stream.claim_stale("alive", min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.06)
    claimed = stream.claim_stale("alive", min_idle_ms=50)
    assert sorted(e.group.prompt_id for e in claimed) == ["0", "1", "2", "3"]
    stream.ack(e.entry_id for e in claimed)
    assert stream.pending_count() == 0


def test_an_entry_deleted_while_a_dead_consumer_held_it_goes_to_dead_letters(
    stream: SampleStream, redis_client: redis.Redis
) -> None:
    """Claiming from a dead consumer dropped an entry deleted meanwhile without a trace: the run waited one
    group short until its step timeout instead of failing at once."""
    ids = [stream.append(make_group("run1", i)) for i in range(4)]
    stream.read("dead", count=4)
    assert ids[1] is not None
    redis_client.xdel(stream.key, ids[1])
    claimed = stream.claim_stale("alive", min_idle_ms=0)
    assert [e.entry_id for e in claimed] == [ids[0], ids[2], ids[3]]
    assert stream.dead_letters() == [(ids[1], "entry was deleted while pending")]
    assert stream.lost_groups() == [(ids[1], "entry was deleted while pending")]
    assert not stream.pending_elsewhere("alive") and stream.pending_count() == 3
    # A move sent again after its reply was lost writes a second dead letter: still one lost group.
    stream._move_to_dead_letters(ids[1], {}, "entry was deleted while pending")
    assert stream.lost_groups() == [(ids[1], "entry was deleted while pending")]


def test_an_entry_its_consumer_acknowledges_and_trims_during_a_claim_is_not_lost(
    stream: SampleStream, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer still committing (acknowledge, then trim) while its successor claimed its idle groups: the groups
    it had trained, gone from the stream by the claim, were taken for deleted while pending and recorded as lost,
    and the orchestrator failed the run for groups that were trained."""
    ids = [cast(str, stream.append(make_group("run1", i))) for i in range(3)]
    stream.read("old", count=3)
    xpending_range = redis_client.xpending_range

    def listed_then_committed(*args: object, **kwargs: object) -> object:
        listed = xpending_range(*args, **kwargs)  # type: ignore[arg-type]
        redis_client.xack(stream.key, stream.consumer_group, ids[0], ids[1])  # the old trainer's commit, just after
        stream.trim_acknowledged()
        return listed

    monkeypatch.setattr(redis_client, "xpending_range", listed_then_committed)
    claimed = stream.claim_stale("new", min_idle_ms=0)
    assert [e.entry_id for e in claimed] == [ids[2]]
    assert stream.dead_letters() == [] and stream.lost_groups() == []


def test_an_entry_deleted_while_pending_is_still_found_by_the_claim_after_one_that_failed(
    stream: SampleStream, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim dropped the deleted entry from the pending list before moving it aside: when the move failed (Redis
    gone past the client's retries, the trainer killed), no claim found it again and no dead letter told of it."""
    ids = [cast(str, stream.append(make_group("run1", i))) for i in range(2)]
    stream.read("old", count=2)
    redis_client.xdel(stream.key, ids[0])
    move = stream._move_to_dead_letters

    def fail(*args: object) -> None:
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(stream, "_move_to_dead_letters", fail)
    with pytest.raises(redis.ConnectionError):
        stream.claim_stale("new", min_idle_ms=0)
    monkeypatch.setattr(stream, "_move_to_dead_letters", move)
    stream.claim_stale("new", min_idle_ms=0)
    assert stream.lost_groups() == [(ids[0], "entry was deleted while pending")]


def test_undecodable_entry_goes_to_dead_letters(stream: SampleStream, redis_client: redis.Redis) -> None:
    redis_client.xadd(stream.key, {"group_id": "x", "group": b"\xff\xff not protobuf"})
    stream.append(make_group("run1", 1))
    entries = stream.read("c", count=10)
    assert [e.group.prompt_id for e in entries] == ["1"]
    [(entry_id, reason)] = stream.dead_letters()
    assert "undecodable" in reason
    assert stream.pending_count() == 1  # the bad entry was acknowledged when moved aside


def test_another_writers_entry_keeps_its_fields_in_the_dead_letter(
    stream: SampleStream, redis_client: redis.Redis
) -> None:
    """An entry without a group field went to the dead letters with an empty payload: what it held was gone."""
    entry_id = cast(bytes, redis_client.xadd(stream.key, {"kind": "note", "body": b"\x00\xffraw"}))
    assert stream.read("c", count=10) == []
    [(_, letter)] = cast(list[tuple[bytes, dict[bytes, bytes]]], redis_client.xrange(stream.dead_key))
    assert letter[b"entry_id"] == entry_id and letter[b"payload"] == b""
    assert letter[b"entry.kind"] == b"note" and letter[b"entry.body"] == b"\x00\xffraw"
    assert stream.pending_count() == 0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g: g.ClearField("group_id"), "group_id"),
        (lambda g: g.ClearField("samples"), "samples"),
        (lambda g: g.samples[0].rollout_logprobs.append(0.0), "rollout_logprobs"),
        (lambda g: g.samples[1].loss_mask.pop(), "loss_mask"),
        (lambda g: setattr(g, "run_id", "other"), "belongs to run other"),
        (lambda g: g.samples[1].rollout_logprobs.__setitem__(0, float("-inf")), r"rollout_logprobs\[0\] is -inf"),
        (lambda g: setattr(g.samples[0], "reward", float("nan")), "reward is nan"),
        (lambda g: g.samples[0].ClearField("prompt_token_ids"), "no prompt token"),
        (lambda g: setattr(g, "weight", -1.0), "weight must be a finite number from 0 to"),
        (lambda g: setattr(g, "weight", 1e39), r"weight must be a finite number from 0 to 1e\+09, got 1e\+39"),
        (lambda g: setattr(g.samples[1], "reward", -1e39), r"samples\[1\].reward is -1e\+39, not a finite number"),
        # Finite in float32, but its group's advantages were not: the step's gradient was, and the step skipped.
        (lambda g: setattr(g.samples[1], "reward", 3e38), r"samples\[1\].reward is 3e\+38, not a finite number within"),
        (lambda g: setattr(g, "weight", 2e9), r"weight must be a finite number from 0 to 1e\+09, got 2000000000"),
        (lambda g: g.samples[0].loss_mask.__setitem__(1, 2), r"samples\[0\].loss_mask\[1\] is 2, not 0 or 1"),
        (lambda g: g.samples[1].prompt_token_ids.__setitem__(2, -1), r"prompt_token_ids\[2\] is -1, not a token id"),
        (lambda g: g.samples[0].response_token_ids.__setitem__(0, -5), r"response_token_ids\[0\] is -5, not a token"),
    ],
)
def test_malformed_groups_are_refused_and_nothing_is_written(stream: SampleStream, mutate, message: str) -> None:
    group = make_group("run1", 0)
    mutate(group)
    with pytest.raises(InvalidInput, match=message):
        stream.append(group)
    assert stream.length() == 0


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda g: g.samples[0].loss_mask.pop(), "samples[0].loss_mask has 1 entries"),
        (lambda g: g.samples[1].rollout_logprobs.__setitem__(0, float("nan")), "samples[1].rollout_logprobs[0] is nan"),
        (lambda g: setattr(g.samples[0], "reward", float("inf")), "samples[0].reward is inf"),
        (lambda g: g.samples[1].ClearField("prompt_token_ids"), "samples[1] has response tokens but no prompt token"),
        (lambda g: setattr(g, "weight", float("nan")), "weight must be a finite number"),
        (lambda g: setattr(g, "run_id", "other"), "belongs to run other"),
        # Finite as the proto's double, infinite as the trainer's float32: the step's loss would be NaN.
        (lambda g: setattr(g.samples[0], "reward", 1e39), "samples[0].reward is 1e+39, not a finite number within"),
        (lambda g: setattr(g, "weight", 1e39), "weight must be a finite number from 0 to 1e+09, got 1e+39"),
        (lambda g: setattr(g.samples[0], "reward", -3e38), "samples[0].reward is -3e+38, not a finite number within"),
        # A token weight of 1000 instead of the documented 1 (trained) or 0 (not).
        (lambda g: g.samples[1].loss_mask.__setitem__(0, 1000), "samples[1].loss_mask[0] is 1000, not 0 or 1"),
        (lambda g: g.samples[0].response_token_ids.__setitem__(1, -1), "samples[0].response_token_ids[1] is -1"),
    ],
)
def test_a_group_written_past_the_producers_checks_goes_to_dead_letters(
    stream: SampleStream, redis_client: redis.Redis, mutate, reason: str
) -> None:
    """Handed to the trainer, it would fail every step that holds it, or make the policy's weights NaN."""
    bad = make_group("run1", 0)
    mutate(bad)
    redis_client.xadd(stream.key, {"group_id": bad.group_id, "group": bad.SerializeToString()})
    stream.append(make_group("run1", 1))
    assert [e.group.prompt_id for e in stream.read("c", count=10)] == ["1"]
    [(_, why)] = stream.dead_letters()
    assert why.startswith("untrainable: ") and reason in why, why
    assert stream.pending_count() == 1


def test_a_token_id_outside_the_readers_vocabulary_goes_to_dead_letters(
    redis_client: redis.Redis, redis_prefix: str
) -> None:
    """The producer cannot know the model's vocabulary; the trainer, reading with it, must not take a group
    whose token ids index past the embedding (every step holding it failed with an IndexError, every resume too)."""
    stream = SampleStream(redis_client, "run1", prefix=redis_prefix, vocab_size=10)
    outside = "outside the vocabulary [0, 10)"
    stream.ensure_consumer_group()
    past_the_end, in_range, bad_prompt = make_group("run1", 0), make_group("run1", 1), make_group("run1", 2)
    past_the_end.samples[1].response_token_ids[1] = 10
    bad_prompt.samples[0].prompt_token_ids[0] = 4000
    ids = [stream.append(g) for g in (past_the_end, in_range, bad_prompt)]  # the producer's checks pass them
    assert all(ids)
    assert [e.group.prompt_id for e in stream.read("c", count=10)] == ["1"]  # ids 5..9 fit
    [(first, why_first), (second, why_second)] = stream.dead_letters()
    assert (first, second) == (ids[0], ids[2])
    assert why_first == "untrainable: SampleGroup run1/0/0: samples[1].response_token_ids[1] is 10, " + outside
    assert why_second == "untrainable: SampleGroup run1/0/2: samples[0].prompt_token_ids[0] is 4000, " + outside
    assert [entry for entry, _ in stream.lost_groups()] == [ids[0], ids[2]]  # the run is short of them
    assert stream.pending_count() == 1


def test_lost_groups_are_the_producers_own_dead_letters(stream: SampleStream, redis_client: redis.Redis) -> None:
    """A group of the run that turned out untrainable, or an entry deleted while pending, leaves the run
    short of groups; another writer's entry (undecodable, another run's group) does not."""
    assert stream.lost_groups() == []
    redis_client.xadd(stream.key, {"group_id": "stray", "group": b"\xff not protobuf"})
    other = make_group("other", 9)
    redis_client.xadd(stream.key, {"group_id": other.group_id, "group": other.SerializeToString()})
    own_bad = make_group("run1", 0)
    own_bad.samples[0].reward = float("nan")  # written by an older producer, past today's checks
    redis_client.sadd(stream.ids_key, own_bad.group_id)
    bad_id = stream.client.xadd(stream.key, {"group_id": own_bad.group_id, "group": own_bad.SerializeToString()})
    assert [e.group.prompt_id for e in stream.read("c", count=10)] == []
    stream.append(make_group("run1", 1))
    stream.append(make_group("run1", 2))
    delivered = stream.read("c", count=1)[0].entry_id
    redis_client.xdel(stream.key, delivered)  # deleted while pending
    assert [e.group.prompt_id for e in stream.read_own_pending("c", count=10)] == []
    assert [e.group.prompt_id for e in stream.read("c", count=10)] == ["2"]

    assert stream.dead_letter_count() == 4
    assert [(entry, reason.split(":")[0]) for entry, reason in stream.lost_groups()] == [
        (cast(bytes, bad_id).decode(), "untrainable"),
        (delivered, "entry was deleted while pending"),
    ]


def test_dead_letters_written_after_the_run_ended_expire_with_its_stream(
    stream: SampleStream, redis_client: redis.Redis
) -> None:
    bad = make_group("run1", 0)
    bad.samples[0].reward = float("nan")  # written past the producer's checks: untrainable, a lost group
    redis_client.sadd(stream.ids_key, bad.group_id)
    redis_client.xadd(stream.key, {"group_id": bad.group_id, "group": bad.SerializeToString()})
    for key in (stream.key, stream.ids_key):  # the run ended: its data expires (run_store)
        redis_client.expire(key, 3600)
    assert redis_client.exists(stream.dead_key, stream.lost_key) == 0
    assert stream.read("c", count=10) == []
    assert [reason.split(":")[0] for _, reason in stream.lost_groups()] == ["untrainable"]
    for key in (stream.dead_key, stream.lost_key):
        assert 3590 < cast(int, redis_client.ttl(key)) <= 3600, key


def test_groups_appended_after_the_run_ended_expire_with_its_stream(
    stream: SampleStream, redis_client: redis.Redis
) -> None:
    """A run cancelled while a step's groups went out: its end expired the stream the trainer had made, and the
    first append then created the id set, which had no expiry and stayed in Redis for good."""
    stream.ensure_consumer_group()
    redis_client.expire(stream.key, 3600)  # the run ended: its data expires (run_store); no id set yet
    assert stream.append(make_group("run1", 0)) is not None
    assert 3590 < cast(int, redis_client.ttl(stream.ids_key)) <= 3600
    redis_client.delete(stream.key)  # and the other way round: the id set outlived by a stream made again
    redis_client.expire(stream.ids_key, 1800)
    assert stream.append(make_group("run1", 1)) is not None
    assert 1790 < cast(int, redis_client.ttl(stream.key)) <= 1800
    redis_client.persist(stream.key)
    redis_client.persist(stream.ids_key)
    assert stream.append(make_group("run1", 2)) is not None  # a running run's keys do not expire
    assert redis_client.ttl(stream.key) == redis_client.ttl(stream.ids_key) == -1


def test_lost_groups_are_counted_from_their_record_once_each(stream: SampleStream, redis_client: redis.Redis) -> None:
    """lost_group_count() (what each /metrics scrape of the trainer subtracts) reads no dead letter's payload but the
    oldest one's, and agrees with lost_groups(): a move retried after a lost reply counts once, with its first
    reason, and another writer's entries not at all."""
    assert stream.lost_group_count() == 0
    redis_client.xadd(stream.key, {"group_id": "stray", "group": b"\xff not protobuf"})  # another writer's
    own_bad = make_group("run1", 0)
    own_bad.samples[0].reward = float("nan")  # written past the producer's checks
    redis_client.sadd(stream.ids_key, own_bad.group_id)
    bad_id = cast(
        bytes, redis_client.xadd(stream.key, {"group_id": own_bad.group_id, "group": own_bad.SerializeToString()})
    )
    assert stream.read("c", count=10) == []
    stream._move_to_dead_letters(bad_id.decode(), {b"group_id": own_bad.group_id.encode()}, "again")  # retried
    assert stream.dead_letter_count() == 3
    [(entry, reason)] = stream.lost_groups()
    assert entry == bad_id.decode() and reason.startswith("untrainable: ")
    assert stream.lost_group_count() == 1
    dead_letters = cast(list[tuple[bytes, dict[bytes, bytes]]], redis_client.xrange(stream.dead_key))
    assert [fields[b"lost"] for _, fields in dead_letters] == [b"0", b"1", b"1"]


def test_dead_letters_moved_aside_before_lost_groups_were_recorded_are_still_found(
    stream: SampleStream, redis_client: redis.Redis
) -> None:
    """A run whose dead letters an older trainer wrote (no `lost` field, nothing recorded): its lost groups are
    found in the dead letters themselves, those moved aside since as well."""
    old_own = make_group("run1", 0)
    redis_client.sadd(stream.ids_key, old_own.group_id)
    for entry_id, group_id, reason in (("1-0", old_own.group_id, "untrainable: old"), ("1-1", "x", "undecodable")):
        redis_client.xadd(
            stream.dead_key, {"entry_id": entry_id, "reason": reason, "group_id": group_id, "payload": ""}
        )
    assert stream.lost_groups() == [("1-0", "untrainable: old")]
    assert stream.lost_group_count() == 1
    appended = stream.append(make_group("run1", 1))
    assert appended is not None
    stream.read("c", count=1)
    redis_client.xdel(stream.key, appended)  # deleted while pending
    assert stream.read_own_pending("c", count=10) == []
    assert stream.lost_groups() == [("1-0", "untrainable: old"), (appended, "entry was deleted while pending")]
    assert stream.lost_group_count() == 2
