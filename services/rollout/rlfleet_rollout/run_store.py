"""Run records in Redis: one `Run` protobuf per run and an index ordered by creation.

Keys (under the configured prefix):
- `run:<id>:record`: the serialized `Run`;
- `run:<id>:revision`: how many times the record was written, counted up in the transaction of each write, so a
  driver can tell its run's record went back in time (run_fence.py); absent (0) for a record written before it;
- `runs:index`: sorted set of run ids scored by a creation sequence number (`runs:seq`), which
  orders List and the run queue and doubles as the page cursor. The number is taken in the transaction that
  writes the run, so runs enter the index in the order of their numbers, and a client paging past the last run
  it saw misses none created since;
- `runs:state:<STATE>` (QUEUED, RUNNING, SUCCEEDED, ...): the runs in that state, scored as in the index, moved
  in the transaction that writes the record's new state. The run queue reads its QUEUED and RUNNING runs, a
  List by state reads its state's runs, and the runs-by-state counts are their sizes: the cost follows the runs
  asked for, not every run ever stored (records are kept). A store written before these sets existed gets them
  built once, from every record, by the first reader that needs them (`runs:state-sets` marks them built;
  deleting it has them built again). Only writers that keep them may write runs: stop orchestrators of a
  release without them before starting one with them (the chart and compose replace the orchestrator);
- `submit-request:<request_id>`: the run a Submit with that request_id made and its spec's digest (JSON), written
  in the transaction that creates the run (WATCH on the key, so two Submits of one request_id store one run) and
  expiring after 24 h (submit_requests.py).

A run's working data (its sample stream, the stream's id set and dead letters, its data position) is given
an expiry in the same transaction as the record that ends the run; the record stays. Dead letters a trainer
writes after that take the stream's expiry (sample_stream.py).

A record is changed by compare-and-set (`update`: WATCH, read, change, MULTI/EXEC, again if another writer came
between), so two orchestrators, or an orchestrator and any other writer, never lose each other's change, and a
change whose EXEC went through is not applied again when only its reply was lost. The run loop's writes of the
run it drives also check, in the same transaction, that the run is still its driver's (`fence`, run_fence.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from rlfleet.errors import InvalidInput, NotFound, Unavailable
from rlfleet.sample_stream import stream_keys
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.run_data import data_position_key
from rlfleet_rollout.run_events import is_terminal, state_name
from rlfleet_rollout.run_fence import RunFence
from rlfleet_rollout.submit_requests import REQUEST_ID_RETENTION_S, RequestRecord, SubmitRequest

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
# A page ends early past this many bytes of records: a run holds its spec (up to 1 MiB) and evaluations,
# and 50 such runs made a ListRuns answer larger than a gRPC client takes by default (4 MiB).
MAX_PAGE_BYTES = 2 * 1024 * 1024
# A write that lost the race for a record waits a random pause, up to this one doubled per loss (so that writers
# in lockstep fall out of it), and tries again for this long before it gives up.
_FIRST_RETRY_PAUSE_S, _MAX_RETRY_PAUSE_S, _UPDATE_WITHIN_S = 0.001, 0.05, 10.0
# Writes a new run's record and indexes it, and under its state, with the next creation number, at once (KEYS:
# record, seq, index, state set, revision; ARGV: record bytes, run id). A number taken before the write let a run
# created later be listed first, and a client paging on past it never saw the earlier one.
_CREATE = """
local number = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], number, ARGV[2])
redis.call('ZADD', KEYS[4], number, ARGV[2])
redis.call('INCR', KEYS[5])
"""
# Writes a run's record and moves it from its old state's set to its new one's, keeping its creation number
# (KEYS: record, old state set, new state set, index; ARGV: record bytes, run id).
_MOVE = """
redis.call('SET', KEYS[1], ARGV[1])
local number = redis.call('ZSCORE', KEYS[4], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[2])
if number then redis.call('ZADD', KEYS[3], number, ARGV[2]) end
"""
# Building the state sets of a store written before them: records whose MGETs share a round trip (and WATCH).
_BUILD_BATCH = 1000
_BUILD_WITHIN_S = 60.0
_STATES = [cast(RunState, state) for state in RunState.values()]


class RunStore:
    def __init__(
        self, client: aioredis.Redis, prefix: str, *, request_id_retention_s: float = REQUEST_ID_RETENTION_S
    ) -> None:
        """`request_id_retention_s`: how long a Submit's request_id is honoured (submit_requests.py)."""
        self.client = client
        self.prefix = prefix
        self.request_id_retention_s = request_id_retention_s
        self.index_key = f"{prefix}runs:index"
        self.seq_key = f"{prefix}runs:seq"
        self.state_sets_built_key = f"{prefix}runs:state-sets"
        self._state_sets_built = False
        self._building = asyncio.Lock()

    def record_key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}:record"

    def revision_key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}:revision"

    def state_key(self, state: RunState) -> str:
        return f"{self.prefix}runs:state:{state_name(state)}"

    def request_key(self, request_id: str) -> str:
        return f"{self.prefix}submit-request:{request_id}"

    async def create(self, run: Run, request: SubmitRequest | None = None) -> RequestRecord | None:
        """Stores a new run at the end of the creation order. With `request` (a Submit's request_id), the run is
        stored only if no run holds that request_id yet, and the request_id is recorded with the run, in one
        transaction, for `request_id_retention_s`: returns None when this call stored the run, else the record
        of the run an earlier Submit of the request_id made (nothing stored)."""
        if request is None:
            async with self.client.pipeline(transaction=True) as pipe:
                self._queue_create(pipe, run)
                await pipe.execute()
            return None
        key = self.request_key(request.request_id)
        mine = RequestRecord(run.id, request.spec_sha256)
        deadline, pause = time.monotonic() + _UPDATE_WITHIN_S, _FIRST_RETRY_PAUSE_S
        while True:
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is not None:
                        earlier = RequestRecord.from_bytes(raw)
                        # Our own write, when its EXEC went through but the reply was lost (see below).
                        return None if earlier == mine else earlier
                    pipe.multi()
                    self._queue_create(pipe, run)
                    pipe.set(key, mine.to_bytes(), ex=math.ceil(self.request_id_retention_s))
                    await pipe.execute()
                    return None
                except WatchError:
                    pass
            # Another Submit of the request_id wrote the key since the WATCH (the next read finds its run), or the
            # connection failed while watching, possibly after Redis ran the EXEC (the next read finds ours).
            if time.monotonic() + pause > deadline:
                raise Unavailable(f"request_id {request.request_id!r}: its record kept changing under each write")
            await asyncio.sleep(random.uniform(0, pause))
            pause = min(2 * pause, _MAX_RETRY_PAUSE_S)

    async def request_record(self, request_id: str) -> RequestRecord | None:
        """The run a Submit of `request_id` made within the retention, if any."""
        raw = await self.client.get(self.request_key(request_id))
        return None if raw is None else RequestRecord.from_bytes(raw)

    def _queue_create(self, pipe: aioredis.client.Pipeline, run: Run) -> None:
        keys = (
            self.record_key(run.id),
            self.seq_key,
            self.index_key,
            self.state_key(run.state),
            self.revision_key(run.id),
        )
        pipe.eval(_CREATE, len(keys), *keys, run.SerializeToString(), run.id)

    async def get(self, run_id: str) -> Run:
        raw = await self.client.get(self.record_key(run_id)) if run_id else None
        if raw is None:
            raise NotFound(f"run {run_id!r} not found")
        return Run.FromString(raw)

    async def update(
        self, run_id: str, mutate: Callable[[Run], None], *, expire_data_after_s: float, fence: RunFence | None = None
    ) -> tuple[Run, Run]:
        """The run before and after `mutate`, applied to the stored record and written back only if nobody wrote the
        record in between (else read and applied again: `mutate` may run more than once, each time on the record as
        it is then, and may raise to refuse the change). Nothing is written when `mutate` changes nothing; the
        write that ends the run gives its working data an expiry of `expire_data_after_s`.

        With `fence` (the run's driver's), the run's lease and the record's revision are read and watched with the
        record, and the write is refused (LeaseLost, RecordLost: run_fence.py) unless the run is still the driver's;
        a record gone is RecordLost then, not NotFound."""
        key, revision_key = self.record_key(run_id), self.revision_key(run_id)
        deadline, pause, lost = time.monotonic() + _UPDATE_WITHIN_S, _FIRST_RETRY_PAUSE_S, 0
        while True:
            sent: bytes | None = None
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    if fence is None:
                        await pipe.watch(key)
                        raw = await pipe.get(key) if run_id else None
                    else:
                        await pipe.watch(key, revision_key, fence.lease_key)
                        holder, raw, revision = await pipe.mget([fence.lease_key, key, revision_key])
                        fence.check(holder, raw is not None, int(revision or 0))
                    if raw is None:
                        raise NotFound(f"run {run_id!r} not found")
                    before, after = Run.FromString(raw), Run.FromString(raw)
                    mutate(after)
                    if after.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True):
                        if fence is not None:
                            fence.revision = int(revision or 0)
                        return before, before
                    ends = is_terminal(after.state) and not is_terminal(before.state)
                    pipe.multi()
                    sent = self._write(pipe, before, after, expire_data_after_s if ends else None)
                    written = await pipe.execute()
                    if fence is not None:
                        fence.revision = int(written[0])
                    return before, after
                except WatchError:
                    lost += 1
            # redis-py raises WatchError too when the connection fails while it watches, so also when Redis ran the
            # EXEC and only its reply was lost: the record holding exactly what this write sent says it went through
            # (another writer's change would have made other bytes).
            if sent is not None and await self.client.get(key) == sent:
                if fence is not None:
                    fence.revision = max(fence.revision, int(await self.client.get(revision_key) or 0))
                return before, after
            if time.monotonic() + pause > deadline:
                raise Unavailable(f"run {run_id}: other writers changed its record under each of {lost} writes")
            await asyncio.sleep(random.uniform(0, pause))
            pause = min(2 * pause, _MAX_RETRY_PAUSE_S)

    def _write(self, pipe: aioredis.client.Pipeline, before: Run, run: Run, expire_data_after_s: float | None) -> bytes:
        """Queues the writes of `run`'s record (stored as `before`), its revision's first (its reply is the new
        revision); returns the record as written."""
        record = run.SerializeToString()
        pipe.incr(self.revision_key(run.id))
        if run.state == before.state:
            pipe.set(self.record_key(run.id), record)
        else:
            keys = (self.record_key(run.id), self.state_key(before.state), self.state_key(run.state), self.index_key)
            pipe.eval(_MOVE, len(keys), *keys, record, run.id)
        if expire_data_after_s is not None:
            for key in (*stream_keys(run.id, self.prefix), data_position_key(run.id, self.prefix)):
                pipe.expire(key, math.ceil(expire_data_after_s))
        return record

    async def page(
        self, state: RunState = RunState.RUN_STATE_UNSPECIFIED, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[Run], str]:
        """Runs in creation order (oldest first); with a `state`, only that state's runs, read from its set rather
        than from every run.

        Returns the page and the token of the next one: the creation number of the page's last run, given
        only once a run of the same kind is found after it ("" when this page is the last), so a token
        never leads to an empty page. A page ends early once its records pass MAX_PAGE_BYTES (it holds one
        run at least).
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidInput(f"page_size: must be between 0 and {MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})")
        page_size = page_size or DEFAULT_PAGE_SIZE
        cursor = _parse_page_token(page_token)
        index = self.index_key
        if state != RunState.RUN_STATE_UNSPECIFIED:
            await self._build_state_sets()
            index = self.state_key(state)
        runs: list[Run] = []
        page_end = 0
        page_bytes = 0
        batch = max(page_size, 100)
        # Each pass moves the cursor forward over the index, so the scan ends with the index.
        while True:
            low = f"({cursor}" if cursor is not None else "-inf"
            # redis-py types this reply loosely; with withscores=True it is (member, score) pairs.
            members = cast(
                list[tuple[bytes, float]],
                await self.client.zrangebyscore(index, low, "+inf", start=0, num=batch, withscores=True),
            )
            if not members:
                return runs, ""
            records = await self.client.mget([self.record_key(member.decode()) for member, _ in members])
            for (_, score), raw in zip(members, records, strict=True):
                cursor = int(score)
                if raw is None:
                    continue
                run = Run.FromString(raw)
                if state != RunState.RUN_STATE_UNSPECIFIED and run.state != state:
                    continue  # changed between the two reads: it is in its new state's set now
                if len(runs) == page_size or (runs and page_bytes + len(raw) > MAX_PAGE_BYTES):
                    return runs, str(page_end)  # a run for the next page: this one is not the last
                runs.append(run)
                page_end = cursor
                page_bytes += len(raw)
            if len(members) < batch:
                return runs, ""

    async def all_in_order(self, states: Sequence[RunState]) -> list[Run]:
        """Every run in one of `states`, oldest first (the run queue's QUEUED and RUNNING runs)."""
        numbered: list[tuple[int, Run]] = []
        for state in states:
            token = ""
            while True:
                page, token = await self.page(state, MAX_PAGE_SIZE, token)
                numbered.extend((number, run) for number, run in zip(await self._numbers(page), page, strict=True))
                if not token:
                    break
        return [run for _, run in sorted(numbered, key=lambda pair: pair[0])]

    async def count_by_state(self) -> Counter[RunState]:
        """How many runs each state holds: the sizes of the state sets, one round trip."""
        await self._build_state_sets()
        states = [state for state in _STATES if state != RunState.RUN_STATE_UNSPECIFIED]
        async with self.client.pipeline(transaction=False) as pipe:
            for state in states:
                pipe.zcard(self.state_key(state))
            sizes = await pipe.execute()
        return Counter({state: size for state, size in zip(states, sizes, strict=True) if size})

    async def _numbers(self, runs: list[Run]) -> list[int]:
        """The runs' creation numbers (a run missing from the index sorts first)."""
        if not runs:
            return []
        scores = await self.client.zmscore(self.index_key, [run.id for run in runs])
        return [int(score or 0) for score in scores]

    async def _build_state_sets(self) -> None:
        """Builds the state sets from every record, once per store (a store written before they existed): read
        and written in one transaction watching the records, so a run changed or created meanwhile has them
        built again from its new state."""
        if self._state_sets_built:
            return
        async with self._building:
            deadline, pause = time.monotonic() + _BUILD_WITHIN_S, _FIRST_RETRY_PAUSE_S
            while not self._state_sets_built:
                try:
                    self._state_sets_built = await self._try_building_state_sets()
                except WatchError:
                    pass
                if self._state_sets_built:
                    return
                if time.monotonic() + pause > deadline:
                    raise Unavailable("the runs' state sets: runs kept changing under each attempt to build them")
                await asyncio.sleep(random.uniform(0, pause))
                pause = min(2 * pause, _MAX_RETRY_PAUSE_S)

    async def _try_building_state_sets(self) -> bool:
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(self.state_sets_built_key, self.seq_key)
            if await pipe.exists(self.state_sets_built_key):
                return True
            members = cast(list[tuple[bytes, float]], await pipe.zrange(self.index_key, 0, -1, withscores=True))
            if members:
                logger.info("building the run store's state sets from its %d runs (once)", len(members))
            by_state: dict[RunState, dict[bytes, float]] = {}
            for start in range(0, len(members), _BUILD_BATCH):
                batch = members[start : start + _BUILD_BATCH]
                keys = [self.record_key(member.decode()) for member, _ in batch]
                await pipe.watch(*keys)
                for (member, score), raw in zip(batch, await pipe.mget(keys), strict=True):
                    if raw is not None:
                        by_state.setdefault(Run.FromString(raw).state, {})[member] = score
            pipe.multi()
            pipe.delete(*(self.state_key(state) for state in _STATES))
            for state, runs in by_state.items():
                items = list(runs.items())
                for start in range(0, len(items), _BUILD_BATCH):
                    pipe.zadd(self.state_key(state), dict(items[start : start + _BUILD_BATCH]))
            pipe.set(self.state_sets_built_key, "1")
            await pipe.execute()
        return True


def _parse_page_token(token: str) -> int | None:
    if not token:
        return None
    # str.isdigit takes '²', which int() does not, and int() refuses over 4,300 digits; a creation number has 19.
    if not (token.isascii() and token.isdigit()) or len(token) > 19:
        raise InvalidInput(f"page_token: {token[:40]!r} is not a token returned by List")
    return int(token)
