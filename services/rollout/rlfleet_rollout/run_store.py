"""Run records in Redis: one `Run` protobuf per run and an index ordered by creation.

Keys (under the configured prefix):
- `run:<id>:record`: the serialized `Run`;
- `runs:index`: sorted set of run ids scored by a creation sequence number (`runs:seq`), which
  orders List and the run queue and doubles as the page cursor. The number is taken in the transaction that
  writes the run, so runs enter the index in the order of their numbers, and a client paging past the last run
  it saw misses none created since;
- `submit-request:<request_id>`: the run a Submit with that request_id made and its spec's digest (JSON), written
  in the transaction that creates the run (WATCH on the key, so two Submits of one request_id store one run) and
  expiring after 24 h (submit_requests.py).

A run's working data (its sample stream, the stream's id set and dead letters, its data position) is given
an expiry in the same transaction as the record that ends the run; the record stays. Dead letters a trainer
writes after that take the stream's expiry (sample_stream.py).

A record is changed by compare-and-set (`update`: WATCH, read, change, MULTI/EXEC, again if another writer came
between), so two orchestrators, or an orchestrator and any other writer, never lose each other's change, and a
change whose EXEC went through is not applied again when only its reply was lost.
"""

from __future__ import annotations

import asyncio
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
from rlfleet_rollout.run_events import is_terminal
from rlfleet_rollout.submit_requests import REQUEST_ID_RETENTION_S, RequestRecord, SubmitRequest

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
# A page ends early past this many bytes of records: a run holds its spec (inline prompts too) and evaluations,
# and 50 such runs made a ListRuns answer larger than a gRPC client takes by default (4 MiB).
MAX_PAGE_BYTES = 2 * 1024 * 1024
# A write that lost the race for a record waits a random pause, up to this one doubled per loss (so that writers
# in lockstep fall out of it), and tries again for this long before it gives up.
_FIRST_RETRY_PAUSE_S, _MAX_RETRY_PAUSE_S, _UPDATE_WITHIN_S = 0.001, 0.05, 10.0
# Writes a new run's record and indexes it under the next creation number, at once (KEYS: record, seq, index;
# ARGV: record bytes, run id). A number taken before the write let a run created later be listed first, and a
# client paging on past it never saw the earlier one.
_CREATE = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[2]), ARGV[2])
"""


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

    def record_key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}:record"

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
        pipe.eval(_CREATE, 3, self.record_key(run.id), self.seq_key, self.index_key, run.SerializeToString(), run.id)

    async def get(self, run_id: str) -> Run:
        raw = await self.client.get(self.record_key(run_id)) if run_id else None
        if raw is None:
            raise NotFound(f"run {run_id!r} not found")
        return Run.FromString(raw)

    async def put(self, run: Run, *, expire_data_after_s: float | None = None) -> None:
        """Overwrites the record of an existing run; with `expire_data_after_s`, the run's working data expires
        that long after, in the same transaction."""
        async with self.client.pipeline(transaction=True) as pipe:
            self._write(pipe, run, expire_data_after_s)
            await pipe.execute()

    async def update(
        self, run_id: str, mutate: Callable[[Run], None], *, expire_data_after_s: float
    ) -> tuple[Run, Run]:
        """The run before and after `mutate`, applied to the stored record and written back only if nobody wrote the
        record in between (else read and applied again: `mutate` may run more than once, each time on the record as
        it is then, and may raise to refuse the change). Nothing is written when `mutate` changes nothing; the
        write that ends the run gives its working data an expiry of `expire_data_after_s`."""
        key = self.record_key(run_id)
        deadline, pause, lost = time.monotonic() + _UPDATE_WITHIN_S, _FIRST_RETRY_PAUSE_S, 0
        while True:
            sent: bytes | None = None
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key) if run_id else None
                    if raw is None:
                        raise NotFound(f"run {run_id!r} not found")
                    before, after = Run.FromString(raw), Run.FromString(raw)
                    mutate(after)
                    if after.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True):
                        return before, before
                    ends = is_terminal(after.state) and not is_terminal(before.state)
                    pipe.multi()
                    sent = self._write(pipe, after, expire_data_after_s if ends else None)
                    await pipe.execute()
                    return before, after
                except WatchError:
                    lost += 1
            # redis-py raises WatchError too when the connection fails while it watches, so also when Redis ran the
            # EXEC and only its reply was lost: the record holding exactly what this write sent says it went through
            # (another writer's change would have made other bytes).
            if sent is not None and await self.client.get(key) == sent:
                return before, after
            if time.monotonic() + pause > deadline:
                raise Unavailable(f"run {run_id}: other writers changed its record under each of {lost} writes")
            await asyncio.sleep(random.uniform(0, pause))
            pause = min(2 * pause, _MAX_RETRY_PAUSE_S)

    def _write(self, pipe: aioredis.client.Pipeline, run: Run, expire_data_after_s: float | None) -> bytes:
        """Queues the writes of `run`'s record; returns the record as written."""
        record = run.SerializeToString()
        pipe.set(self.record_key(run.id), record)
        if expire_data_after_s is not None:
            for key in (*stream_keys(run.id, self.prefix), data_position_key(run.id, self.prefix)):
                pipe.expire(key, math.ceil(expire_data_after_s))
        return record

    async def page(
        self, state: RunState = RunState.RUN_STATE_UNSPECIFIED, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[Run], str]:
        """Runs in creation order (oldest first), only those in `state` unless it is unspecified.

        Returns the page and the token of the next one: the creation number of the page's last run, given
        only once a run of the same kind is found after it ("" when this page is the last), so a token
        never leads to an empty page. A page ends early once its records pass MAX_PAGE_BYTES (it holds one
        run at least).
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidInput(f"page_size: must be between 0 and {MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})")
        page_size = page_size or DEFAULT_PAGE_SIZE
        cursor = _parse_page_token(page_token)
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
                await self.client.zrangebyscore(self.index_key, low, "+inf", start=0, num=batch, withscores=True),
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
                    continue
                if len(runs) == page_size or (runs and page_bytes + len(raw) > MAX_PAGE_BYTES):
                    return runs, str(page_end)  # a run for the next page: this one is not the last
                runs.append(run)
                page_end = cursor
                page_bytes += len(raw)
            if len(members) < batch:
                return runs, ""

    async def all_in_order(self, states: Sequence[RunState]) -> list[Run]:
        """Every run in one of `states`, oldest first (for the queue at start-up)."""
        out: list[Run] = []
        token = ""
        while True:
            page, token = await self.page(page_size=MAX_PAGE_SIZE, page_token=token)
            out.extend(run for run in page if run.state in states)
            if not token:
                return out

    async def count_by_state(self) -> Counter[RunState]:
        """How many runs each state holds, read from every record (MAX_PAGE_SIZE records a round trip)."""
        counts: Counter[RunState] = Counter()
        token = ""
        while True:
            page, token = await self.page(page_size=MAX_PAGE_SIZE, page_token=token)
            counts.update(run.state for run in page)
            if not token:
                return counts


def _parse_page_token(token: str) -> int | None:
    if not token:
        return None
    # str.isdigit takes '²', which int() does not, and int() refuses over 4,300 digits; a creation number has 19.
    if not (token.isascii() and token.isdigit()) or len(token) > 19:
        raise InvalidInput(f"page_token: {token[:40]!r} is not a token returned by List")
    return int(token)
