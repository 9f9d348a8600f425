"""A run's sample stream: SampleGroups (protobuf) on a Redis stream, from the orchestrator (the only
writer) to the trainer (the only reader, through a consumer group).

Delivery is at least once and nothing is lost: an entry stays pending in the consumer group until
the trainer acknowledges it, and entries left pending by a dead consumer are claimed again
(`claim_stale`). Writing is idempotent per `group_id`: a group the stream has already seen is not
appended twice, so a producer that retries or restarts cannot duplicate a group; an append whose reply was lost
and which its client sent again is still answered its entry, not "appended before". An entry that
cannot be decoded, or whose group cannot be trained on (`check_trainable`), is moved to the run's
dead-letter stream with the reason, never silently dropped and never handed to the trainer; one the run
is short of (its own group, or an entry deleted while pending) is also recorded in a small hash, so counting
them reads no payload.
Acknowledged entries are trimmed (`trim_acknowledged`, at each checkpoint commit), so a long run's
stream holds the groups not yet trained rather than every group of the run; the id set keeps every
group id appended (and so the count of groups produced).
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from rlfleet.errors import InvalidInput
from rlfleet.v1.samples_pb2 import SampleGroup

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "rlfleet:"
DEFAULT_CONSUMER_GROUP = "trainer"
_GROUP_FIELD = b"group"
_DELETED = "entry was deleted while pending"
_ID_FIELD = b"group_id"

# Append unless the group id was seen before, atomically (a crash between the two steps would
# otherwise either lose the group or let it be written twice). Each append leaves a receipt, KEYS[3] (named by a token
# of that append's own) holding its entry id for ARGV[3] ms: the client sends a command again when its connection
# drops, also after Redis ran it, and the append sent again finds its group id seen and its receipt there, and answers
# the entry it made rather than "appended before", which its producer would not count. Once the run has ended its
# keys expire; a key an append after the end creates (the id set, at the first group of a run cancelled while it
# produced) expires with the other instead of staying for good.
_APPEND_ONCE = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then
  return redis.call('GET', KEYS[3])
end
local id = redis.call('XADD', KEYS[1], '*', 'group_id', ARGV[1], 'group', ARGV[2])
redis.call('SET', KEYS[3], id, 'PX', ARGV[3])
local stream_ttl, ids_ttl = redis.call('PTTL', KEYS[1]), redis.call('PTTL', KEYS[2])
if stream_ttl > 0 and ids_ttl == -1 then
  redis.call('PEXPIRE', KEYS[2], stream_ttl)
elseif ids_ttl > 0 and stream_ttl == -1 then
  redis.call('PEXPIRE', KEYS[1], ids_ttl)
end
return id
"""


# Trims the entries of stream KEYS[1] that every consumer group has had delivered and acknowledged: those
# older than each group's oldest pending entry, or up to its last delivered one when none is pending.
_TRIM_ACKNOWLEDGED = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local bound = false
for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, last
  for i = 1, #info, 2 do
    if info[i] == 'name' then name = info[i + 1] elseif info[i] == 'last-delivered-id' then last = info[i + 1] end
  end
  local pending = redis.call('XPENDING', KEYS[1], name)
  local keep
  if pending[1] > 0 then
    keep = pending[2]
  else
    local ms, seq = parse(last)
    keep = string.format('%d-%d', ms, seq + 1)
  end
  if not bound or older(keep, bound) then
    bound = keep
  end
end
if not bound then
  return 0
end
return redis.call('XTRIM', KEYS[1], 'MINID', bound)
"""


# Moves an entry aside, atomically: its dead letter on KEYS[1], its acknowledgement on stream KEYS[2] (consumer group
# ARGV[1]), and, when the run is short of it (an entry deleted while pending, ARGV[6] = '1', or a group of the
# producer's: its id is in the id set KEYS[3]), its entry id and reason in the hash KEYS[4], which counting the lost
# groups reads instead of every dead letter's payload. HSETNX: a move sent again after a lost reply writes a second
# dead letter, not a second lost group. The dead letter's `lost` field says which it was (and that KEYS[4] has it).
# ARGV[7..]: the entry's other fields, name and value in turn (another writer's entry), kept in the dead letter.
# Once the run has ended its stream expires (the orchestrator's data retention); keys this creates then (the first
# dead letter, or lost group, read after the end) expire with it instead of staying for good.
_MOVE_TO_DEAD_LETTERS = """
local lost = ARGV[6] == '1' or (ARGV[4] ~= '' and redis.call('SISMEMBER', KEYS[3], ARGV[4]) == 1)
local letter = {'entry_id', ARGV[2], 'reason', ARGV[3], 'group_id', ARGV[4], 'payload', ARGV[5],
  'lost', lost and '1' or '0'}
for i = 7, #ARGV do
  letter[#letter + 1] = ARGV[i]
end
redis.call('XADD', KEYS[1], '*', unpack(letter))
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
if lost then
  redis.call('HSETNX', KEYS[4], ARGV[2], ARGV[3])
end
local ttl = redis.call('PTTL', KEYS[2])
if ttl > 0 then
  for _, key in ipairs({KEYS[1], KEYS[4]}) do
    if redis.call('PTTL', key) == -1 then
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
return lost and 1 or 0
"""
_LOST_FIELD = b"lost"

# XCLAIMs for consumer ARGV[2] of consumer group ARGV[1] the entries ARGV[4..] of stream KEYS[1] still pending and
# on the stream, if idle for ARGV[3] ms; answers {those pending but gone from the stream, XCLAIM's reply}. Those were
# deleted while pending: they are left pending for the caller to move to the dead letters (XCLAIM would drop them
# from the pending list without a trace), and told apart here, not after XCLAIM, where an entry that its consumer
# acknowledged and trimmed meanwhile (a trainer still committing) looked deleted as well, and failed the run for a
# group it had trained.
_CLAIM_PRESENT = """
local deleted, present = {}, {}
for i = 4, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1) > 0 then
    if #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i], 'COUNT', 1) > 0 then
      present[#present + 1] = ARGV[i]
    else
      deleted[#deleted + 1] = ARGV[i]
    end
  end
end
if #present == 0 then
  return {deleted, {}}
end
return {deleted, redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], unpack(present))}
"""


def entry_order(entry_id: bytes | str) -> tuple[int, int]:
    """Sort key of stream entry ids ("<ms>-<seq>"), which do not sort as strings."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    millis, _, seq = raw.partition("-")
    return int(millis), int(seq or 0)


def _by_entry_id(reasons: dict[str, str]) -> list[tuple[str, str]]:
    return sorted(reasons.items(), key=lambda item: entry_order(item[0]))


@dataclass(frozen=True)
class StreamEntry:
    entry_id: str
    group: SampleGroup


REDIS_RETRY_BUDGET_S = 30.0
"""How long a Redis command keeps retrying a lost connection or a timeout (a Redis restart) before it raises,
from its first attempt: no retry starts past it, so the command ends within it and one more attempt's socket
timeout. (Counting retries alone, a Redis that accepts connections but does not answer cost each attempt its
socket timeout: 18 attempts of 10 s and the backoffs between them, three and a half minutes.)"""
REDIS_RETRY_ERRORS: tuple[type[redis.RedisError], ...] = (redis.ConnectionError, redis.TimeoutError)
APPEND_RECEIPT_TTL_S = 4 * REDIS_RETRY_BUDGET_S
"""How long an append's receipt is kept (`_APPEND_ONCE`): well past the last attempt of its client's retries, which
starts within REDIS_RETRY_BUDGET_S of the first."""
_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.1, 2.0
# redis-py has no class for these refusals; inside a transaction it prefixes the reply with the command that met it
# ("Command # 1 (SET ...) of pipeline caused error: ('MISCONF ...',)").
_REFUSALS = {
    "MISCONF": "Redis cannot persist to disk, and stops writes until it can (MISCONF; its log says why)",
    "NOREPLICAS": "Redis reaches fewer replicas than its min-replicas-to-write, and stops writes until it does "
    "(NOREPLICAS)",
    "MASTERDOWN": "Redis is a replica cut off from its primary, and serves nothing until it is back (MASTERDOWN)",
}
_REFUSAL = re.compile(rf"""(?:^|of pipeline caused error: \(?["']?)({"|".join(_REFUSALS)}) """)
_HEALTH_CHECK_INTERVAL_S = 10


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)


class _Spent(Exception):
    """The retry budget ran out: raised by the backoff in place of a wait, after the failed attempt's connection
    was dropped, with the attempt's error as its context."""


class _BackoffWithin(ExponentialBackoff):
    """`_backoff()`'s waits, within `within_s` of the outermost call's start. redis-py resets a connection's backoff
    as each call begins, and calls again inside a command's call to reconnect (its handshake can time out too): the
    deadline is the command's. A connection runs one command at a time and holds a copy of its client's retry."""

    def __init__(self, within_s: float) -> None:
        super().__init__(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
        self._within_s = within_s
        self._deadline = math.inf
        self.calls = 0
        """Calls under way on this connection, the outermost first."""

    def reset(self) -> None:
        super().reset()
        if self.calls <= 1:
            self._deadline = time.monotonic() + self._within_s

    def compute(self, failures: int) -> float:
        wait = super().compute(failures)
        if time.monotonic() + wait > self._deadline:
            raise _Spent
        return wait


class _RetryWithin(Retry):
    """Retry whose retries end with REDIS_RETRY_BUDGET_S from the call's start, raising the last error."""

    def call_with_retry(self, *args: Any, **kwargs: Any) -> Any:
        backoff = cast(_BackoffWithin, self._backoff)
        backoff.calls += 1
        try:
            return super().call_with_retry(*args, **kwargs)
        except _Spent as spent:
            raise cast(BaseException, spent.__context__) from None
        finally:
            backoff.calls -= 1


class _AsyncRetryWithin(AsyncRetry):
    """`_RetryWithin` for the asyncio client."""

    async def call_with_retry(self, *args: Any, **kwargs: Any) -> Any:
        backoff = cast(_BackoffWithin, self._backoff)
        backoff.calls += 1
        try:
            return await super().call_with_retry(*args, **kwargs)
        except _Spent as spent:
            raise cast(BaseException, spent.__context__) from None
        finally:
            backoff.calls -= 1


def _retries_within(budget_s: float) -> int:
    """How many retries the backoff allows before its waits add up to `budget_s`."""
    backoff, waited, retries = _backoff(), 0.0, 0
    while waited + backoff.compute(retries + 1) <= budget_s:
        retries += 1
        waited += backoff.compute(retries)
    return retries


def _client_options(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "socket_keepalive": True,
        # A pooled connection idle this long is pinged before use, so one left broken by a Redis
        # restart is replaced before a command is sent on it.
        "health_check_interval": _HEALTH_CHECK_INTERVAL_S,
    }


def connect_redis(url: str, timeout_s: float = 10.0) -> redis.Redis:
    """A client that never waits forever and waits out a Redis restart: each call is bounded by
    connect and socket timeouts of `timeout_s`, and retried on a lost connection or a timeout with
    exponential backoff for up to REDIS_RETRY_BUDGET_S. Every service's synchronous client is made here.

    Retrying is safe for what the fleet writes: stream appends are idempotent per group_id (a
    retried append of a group already written adds nothing, and is answered the entry it made),
    acknowledgements and the trainer's record (absolute values, MULTI/EXEC) can be applied twice,
    and a WATCHed transaction is never retried by the client (it raises WatchError)."""
    budget = REDIS_RETRY_BUDGET_S
    retry = _RetryWithin(_BackoffWithin(budget), _retries_within(budget), supported_errors=REDIS_RETRY_ERRORS)
    return redis.Redis.from_url(url, retry=retry, **_client_options(timeout_s))


def redis_refusal(exc: BaseException) -> str | None:
    """Why Redis refused a write, when `exc` is Redis refusing it for a state of its own that lasts until an operator
    (or a failover) ends it: full at its maxmemory, a read-only replica, unable to persist, short of the replicas
    it must write to, a replica cut off from its primary. None for any other error.
    The text is for logs and callers: the error's own may quote the command, a run's serialized record."""
    if isinstance(exc, redis.OutOfMemoryError):
        return "Redis is full: its used memory is over its maxmemory (OOM)"
    if isinstance(exc, redis.ReadOnlyError):
        return "Redis is a read-only replica (READONLY)"
    if isinstance(exc, redis.ResponseError) and (refusal := _REFUSAL.search(str(exc))):
        return _REFUSALS[refusal.group(1)]
    return None


def redis_unavailable(exc: BaseException) -> bool:
    """Whether `exc` says Redis cannot serve for now: unreachable past the client's retries, or refusing writes.
    A retry later may succeed, so a service answers it as Unavailable rather than as a fault of its own."""
    return isinstance(exc, REDIS_RETRY_ERRORS) or redis_refusal(exc) is not None


def connect_redis_async(url: str, timeout_s: float = 10.0, *, max_connections: int | None = None) -> aioredis.Redis:
    """The asyncio twin of `connect_redis`, with the same timeouts and retry policy.

    With `max_connections`, a command that finds them all in use waits up to `timeout_s` for one, then raises
    ConnectionError ("No connection available."); without, the pool holds redis-py's default (100) and such a
    command fails at once (MaxConnectionsError): the bound is for a client shared by callers whose number nothing
    else bounds (the orchestrator's Runs API)."""
    budget = REDIS_RETRY_BUDGET_S
    retry = _AsyncRetryWithin(_BackoffWithin(budget), _retries_within(budget), supported_errors=REDIS_RETRY_ERRORS)
    if max_connections is None:
        return aioredis.Redis.from_url(url, retry=retry, **_client_options(timeout_s))
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout_s, retry=retry, **_client_options(timeout_s)
    )
    return aioredis.Redis.from_pool(pool)


MAX_MAGNITUDE = 1e9
"""The largest reward or group weight, in magnitude: far beyond any reward scale in use, and small enough that the
trainer's float32 arithmetic on it stays finite (a reward finite in float32, 3e38, made its group's advantages
infinite, and with them the step's gradient: the whole step was skipped, its other groups with it)."""


def _in_range(value: float) -> bool:
    """Whether `value` is finite and within MAX_MAGNITUDE (a double up to 1.8e308 need not be)."""
    return math.isfinite(value) and abs(value) <= MAX_MAGNITUDE


def _token_out_of_range(ids: Sequence[int], vocab_size: int | None) -> tuple[int, int] | None:
    """(position, id) of the first token id outside [0, vocab_size) (below 0 when the size is not known)."""
    limit = vocab_size if vocab_size is not None else math.inf
    if not ids or (min(ids) >= 0 and max(ids) < limit):  # the usual case, without a Python loop over the tokens
        return None
    return next((j, t) for j, t in enumerate(ids) if not 0 <= t < limit)


def validate_group(group: SampleGroup, vocab_size: int | None = None) -> None:
    """Raises InvalidInput naming the first field that would make the group untrainable: one that would fail
    every step holding it (lengths that disagree, a response with no prompt token to score it from, a token id
    outside the vocabulary: below 0, or from `vocab_size` on when it is given) or silently corrupt the step's
    loss (a loss_mask value other than 0 or 1, a reward or weight not finite or past MAX_MAGNITUDE, where the
    trainer's float32 arithmetic overflows)."""
    if not group.group_id:
        raise InvalidInput("SampleGroup.group_id must be set")
    if not group.run_id:
        raise InvalidInput(f"SampleGroup {group.group_id}: run_id must be set")
    if not group.samples:
        raise InvalidInput(f"SampleGroup {group.group_id}: samples must not be empty")
    if not (_in_range(group.weight) and group.weight >= 0):
        raise InvalidInput(
            f"SampleGroup {group.group_id}: weight must be a finite number from 0 to {MAX_MAGNITUDE:g}, "
            f"got {group.weight}"
        )
    for i, sample in enumerate(group.samples):
        n = len(sample.response_token_ids)
        for name in ("rollout_logprobs", "loss_mask"):
            got = len(getattr(sample, name))
            if got != n:
                raise InvalidInput(
                    f"SampleGroup {group.group_id}: samples[{i}].{name} has {got} entries "
                    f"but response_token_ids has {n}"
                )
        if n and not sample.prompt_token_ids:
            raise InvalidInput(
                f"SampleGroup {group.group_id}: samples[{i}] has response tokens but no prompt token "
                "(the first response token is scored from the token before it)"
            )
        for name in ("prompt_token_ids", "response_token_ids"):
            bad_token = _token_out_of_range(getattr(sample, name), vocab_size)
            if bad_token is not None:
                where, token = bad_token
                outside = f"outside the vocabulary [0, {vocab_size})" if vocab_size is not None else "not a token id"
                raise InvalidInput(f"SampleGroup {group.group_id}: samples[{i}].{name}[{where}] is {token}, {outside}")
        if sample.loss_mask and max(sample.loss_mask) > 1:
            bad_mask = next(j for j, m in enumerate(sample.loss_mask) if m > 1)
            raise InvalidInput(
                f"SampleGroup {group.group_id}: samples[{i}].loss_mask[{bad_mask}] is {sample.loss_mask[bad_mask]}, "
                "not 0 or 1"
            )
        if not _in_range(sample.reward):
            raise InvalidInput(
                f"SampleGroup {group.group_id}: samples[{i}].reward is {sample.reward}, not a finite number within "
                f"+-{MAX_MAGNITUDE:g}"
            )
        bad = next((j for j, logprob in enumerate(sample.rollout_logprobs) if not math.isfinite(logprob)), None)
        if bad is not None:
            raise InvalidInput(
                f"SampleGroup {group.group_id}: samples[{i}].rollout_logprobs[{bad}] is {sample.rollout_logprobs[bad]}"
            )


def check_trainable(group: SampleGroup, run_id: str, vocab_size: int | None = None) -> None:
    """Raises InvalidInput naming what makes a group read from the stream of run `run_id` untrainable: what
    `validate_group` refuses (`append` applies it, a writer that bypasses it does not; only the reader knows
    the model's `vocab_size`), or another run's group."""
    validate_group(group, vocab_size)
    if group.run_id != run_id:
        raise InvalidInput(f"SampleGroup {group.group_id} belongs to run {group.run_id}, not {run_id}")


def stream_keys(run_id: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, str, str, str]:
    """The keys of run `run_id`'s stream: the stream, the set of group ids appended, the dead letters, and the lost
    groups among them (entry id -> reason)."""
    run = f"{prefix}run:{run_id}"
    return f"{run}:groups", f"{run}:group_ids", f"{run}:dead", f"{run}:lost"


class SampleStream:
    """The stream `<prefix>run:<run_id>:groups` and its consumer group."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        consumer_group: str = DEFAULT_CONSUMER_GROUP,
        vocab_size: int | None = None,
    ) -> None:
        """`vocab_size`: the reader's model's vocabulary; an entry holding a token id outside it goes to the dead
        letters (the producer's `append` cannot check this: it does not know the model)."""
        if not run_id:
            raise ValueError("run_id must be non-empty")
        self.client = client
        self.run_id = run_id
        self.consumer_group = consumer_group
        self.vocab_size = vocab_size
        self.key, self.ids_key, self.dead_key, self.lost_key = stream_keys(run_id, prefix)
        self._append_once = client.register_script(_APPEND_ONCE)
        self._trim_acknowledged = client.register_script(_TRIM_ACKNOWLEDGED)
        self._move_aside = client.register_script(_MOVE_TO_DEAD_LETTERS)
        self._claim_present = client.register_script(_CLAIM_PRESENT)

    # -- producer -------------------------------------------------------------------------------

    def append(self, group: SampleGroup) -> str | None:
        """Appends `group`; returns its entry id, or None when this group_id was appended before, by another call
        (a call whose first attempt landed and whose reply was lost returns the entry that attempt made)."""
        validate_group(group)
        if group.run_id != self.run_id:
            raise InvalidInput(f"SampleGroup {group.group_id} belongs to run {group.run_id}, not {self.run_id}")
        receipt = f"{self.key}:receipt:{uuid.uuid4().hex}"
        entry_id = self._append_once(
            keys=[self.key, self.ids_key, receipt],
            args=[group.group_id, group.SerializeToString(), math.ceil(APPEND_RECEIPT_TTL_S * 1000)],
        )
        if entry_id is None:
            logger.info("group %s already on stream %s; not appended again", group.group_id, self.key)
            return None
        return entry_id.decode()

    def holds(self, group_ids: list[str]) -> list[bool]:
        """Whether a group of each id was appended (trained or not), in one round trip."""
        return [bool(found) for found in cast(list[int], self.client.smismember(self.ids_key, group_ids))]

    # -- consumer -------------------------------------------------------------------------------

    def ensure_consumer_group(self) -> None:
        """Creates the consumer group (and the stream) if missing; reading starts at the beginning."""
        try:
            self.client.xgroup_create(self.key, self.consumer_group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[StreamEntry]:
        """Up to `count` entries never delivered to the group, waiting at most `block_ms` for one."""
        return self._read(consumer, count, ">", block_ms)

    def read_own_pending(self, consumer: str, count: int, after: str = "0") -> list[StreamEntry]:
        """Entries delivered to `consumer` but not acknowledged (e.g. before this process restarted),
        in id order, starting after entry id `after`."""
        return self._read(consumer, count, after, None)

    def own_pending_between(self, consumer: str, after: str, upto: str, limit: int) -> int:
        """How many entries pending on `consumer` have ids after `after` and up to `upto` (at most `limit`
        counted): ids only, so it is cheap to ask once per read."""
        rows = self.client.xpending_range(
            self.key, self.consumer_group, min=f"({after}", max=upto, count=limit, consumername=consumer
        )
        return len(cast(list[Any], rows))

    def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        """Takes over up to `count` entries pending on other consumers for at least `min_idle_ms`
        (a consumer that died), oldest first. Entries pending on `consumer` itself are left alone: it
        may hold them on purpose (the trainer acknowledges only what a checkpoint covers). An entry
        deleted from the stream while pending goes to the dead letters, as on the consumer's own list."""
        stale: list[bytes] = []
        for name in self._others_with_pending(consumer):
            rows = cast(
                list[dict[str, Any]],
                self.client.xpending_range(
                    self.key, self.consumer_group, min="-", max="+", count=count, consumername=name, idle=min_idle_ms
                ),
            )
            stale.extend(row["message_id"] for row in rows)
        if not stale:
            return []
        oldest = sorted(stale, key=entry_order)[:count]
        deleted, claimed = cast(
            list[list[Any]],
            self._claim_present(keys=[self.key], args=[self.consumer_group, consumer, min_idle_ms, *oldest]),
        )
        for raw_id in deleted:
            self._move_to_dead_letters(raw_id.decode(), {}, _DELETED)
        return self._decode([(raw_id, dict(zip(flat[::2], flat[1::2], strict=True))) for raw_id, flat in claimed])

    def pending_elsewhere(self, consumer: str) -> bool:
        """Whether consumers other than `consumer` hold pending entries (a trainer that ran under another name)."""
        return bool(self._others_with_pending(consumer))

    def _others_with_pending(self, consumer: str) -> list[str]:
        consumers = cast(list[dict[str, Any]], self.client.xinfo_consumers(self.key, self.consumer_group))
        names = [
            (info["name"].decode() if isinstance(info["name"], bytes) else str(info["name"]), info)
            for info in consumers
        ]
        return [name for name, info in names if name != consumer and info["pending"]]

    def ack(self, entry_ids: Iterable[str]) -> int:
        ids = list(entry_ids)
        return int(self.client.xack(self.key, self.consumer_group, *ids)) if ids else 0

    def trim_acknowledged(self) -> int:
        """Removes the entries every consumer group has acknowledged (none pending or undelivered); returns how
        many."""
        return int(self._trim_acknowledged(keys=[self.key]))

    # -- inspection -----------------------------------------------------------------------------

    def length(self) -> int:
        """Entries on the stream now: the groups not yet acknowledged, and acknowledged ones not yet trimmed."""
        return int(self.client.xlen(self.key))

    def appended_count(self) -> int:
        """Groups ever appended (trimmed or not)."""
        return int(cast(int, self.client.scard(self.ids_key)))

    def pending_count(self) -> int:
        try:
            return int(self.client.xpending(self.key, self.consumer_group)["pending"])
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                return 0
            raise

    def entries(self) -> list[StreamEntry]:
        """Every group on the stream, oldest first, trained or not, trimmed ones excepted (reading for training
        goes through read())."""
        rows = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(self.key))
        return [StreamEntry(raw_id.decode(), SampleGroup.FromString(fields[_GROUP_FIELD])) for raw_id, fields in rows]

    def dead_letters(self) -> list[tuple[str, str]]:
        """(entry id, reason) of every entry moved aside: undecodable, untrainable, or deleted while pending."""
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(self.dead_key))
        return [(fields[b"entry_id"].decode(), fields[b"reason"].decode()) for _, fields in entries]

    def dead_letter_count(self) -> int:
        return int(cast(int, self.client.xlen(self.dead_key)))

    def lost_groups(self) -> list[tuple[str, str]]:
        """(entry id, reason) of the dead letters that were groups this stream's producer appended (their
        group id is in its id set) or entries deleted while pending: groups the run is now short of, in entry id
        order. Another writer's entries (another run's groups, ones without a group id) are not among them. Each
        entry once: a move whose reply was lost and that the client sent again wrote its dead letter twice."""
        if not self._lost_recorded():
            return self._scan_lost_groups()
        lost = cast(dict[bytes, bytes], self.client.hgetall(self.lost_key))
        return _by_entry_id({entry.decode(): reason.decode() for entry, reason in lost.items()})

    def lost_group_count(self) -> int:
        """len(lost_groups()), in a few small commands: no dead letter's payload is read (but the first one's)."""
        if not self._lost_recorded():
            return len(self._scan_lost_groups())
        return int(cast(int, self.client.hlen(self.lost_key)))

    def _lost_recorded(self) -> bool:
        """Whether every dead letter's lost group is in the lost hash: the first one (the oldest) was moved aside
        with it (it has a `lost` field), so all later ones were too. Dead letters of an older version have none."""
        first = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(self.dead_key, count=1))
        return not first or _LOST_FIELD in first[0][1]

    def _scan_lost_groups(self) -> list[tuple[str, str]]:
        """lost_groups() from the dead letters themselves, payloads and all: for those moved aside by a version
        that did not record them in the lost hash."""
        lost: dict[str, str] = {}
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(self.dead_key))
        for _, fields in entries:
            group_id = fields.get(b"group_id", b"").decode(errors="replace")
            deleted = fields[b"reason"].decode() == _DELETED
            if deleted or (group_id and self.client.sismember(self.ids_key, group_id)):
                lost.setdefault(fields[b"entry_id"].decode(), fields[b"reason"].decode())
        return _by_entry_id(lost)

    # -- internals ------------------------------------------------------------------------------

    def _read(self, consumer: str, count: int, start: str, block_ms: int | None) -> list[StreamEntry]:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        # The client returns bytes (decode_responses is off): [[stream key, [(id, fields), ...]]].
        reply = cast(
            list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None,
            self.client.xreadgroup(self.consumer_group, consumer, {self.key: start}, count=count, block=block_ms),
        )
        if not reply:
            return []
        _, messages = reply[0]
        return self._decode(messages)

    def _decode(self, messages: list[tuple[bytes, dict[bytes, bytes]]]) -> list[StreamEntry]:
        entries = []
        for raw_id, fields in messages:
            entry_id = raw_id.decode()
            if not fields:  # deleted from the stream while pending (XDEL / trimming)
                self._move_to_dead_letters(entry_id, fields, _DELETED)
                continue
            try:
                group = SampleGroup.FromString(fields[_GROUP_FIELD])
            except (KeyError, DecodeError) as exc:
                self._move_to_dead_letters(entry_id, fields, f"undecodable: {exc!r}")
                continue
            try:
                check_trainable(group, self.run_id, self.vocab_size)
            except InvalidInput as exc:
                self._move_to_dead_letters(entry_id, fields, f"untrainable: {exc}")
                continue
            entries.append(StreamEntry(entry_id, group))
        return entries

    def _move_to_dead_letters(self, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        """Copies the entry (its group id and payload, empty when it was deleted; any other field it holds as
        `entry.<name>`) to the dead letters with `reason`, acknowledges it, and records it as lost when the run is
        short of it (_MOVE_TO_DEAD_LETTERS)."""
        logger.error("stream %s entry %s moved to %s: %s", self.key, entry_id, self.dead_key, reason)
        others = [
            part
            for name, value in fields.items()
            if name not in (_ID_FIELD, _GROUP_FIELD)
            for part in (b"entry." + name, value)
        ]
        self._move_aside(
            keys=[self.dead_key, self.key, self.ids_key, self.lost_key],
            args=[
                self.consumer_group,
                entry_id,
                reason,
                fields.get(_ID_FIELD, b""),
                fields.get(_GROUP_FIELD, b""),
                "1" if reason == _DELETED else "0",
                *others,
            ],
        )
