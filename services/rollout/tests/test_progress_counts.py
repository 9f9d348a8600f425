"""A run's filtered and down-weighted counts take each step once, whatever happens to the writes that record them,
so that prompts_consumed - groups_produced == groups_filtered after every step.

The review found two ways to break that: a progress write whose EXEC went through but whose reply came after the
socket timeout (redis-py raises WatchError, and the compare-and-set applied the change again: the step counted
twice), and an orchestrator that died between recording a step's data position and writing its progress (the
next one never counted the step). Every change of a run's record had the first fault: Cancel answered Conflict for
the run it had just cancelled. Real Redis, behind a proxy that holds back one EXEC reply where a test needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from google.protobuf import json_format
from rollout_test_support import REDIS_URL
from trainer_release_support import runs_core

from rlfleet.errors import Conflict
from rlfleet.run_spec import resolve
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import LoadedDataset, Prompt
from rlfleet_rollout.group_filters import FilterRegistry, zero_variance
from rlfleet_rollout.group_producer import GroupRequest
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.run_data import DataPosition, RunData
from rlfleet_rollout.run_loop import RunDeps, _produce_step
from rlfleet_rollout.runs_core import RunsCore

RUN = "run-1"
GROUPS_PER_STEP = 2
PROMPTS_PER_STEP = 4  # oversample 2: one wave, half of it solved
SOCKET_TIMEOUT_S, LATE_BY_S = 0.5, 1.0
RUNNING, CANCELLED = RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_CANCELLED


class LateExecReply:
    """A loopback proxy to the real Redis that, once armed, holds back its reply to the next EXEC for LATE_BY_S, past
    the client's socket timeout: Redis has run the transaction, only its answer is late."""

    def __init__(self) -> None:
        self.armed = False
        self.held_back = 0
        self._connections: set[asyncio.Task[Any]] = set()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """The proxy's Redis URL while it serves."""
        server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        try:
            yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
        finally:
            server.close()
            for task in self._connections:
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def _connect(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        upstream = urlsplit(REDIS_URL)
        redis_in, redis_out = await asyncio.open_connection(upstream.hostname, upstream.port or 6379)
        late = [False]
        await asyncio.gather(
            self._pipe(client_in, redis_out, late, True), self._pipe(redis_in, client_out, late, False)
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, late: list[bool], to_redis: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if to_redis and self.armed and b"EXEC" in data:
                    self.armed, late[0] = False, True
                elif not to_redis and late[0]:
                    late[0] = False
                    self.held_back += 1
                    await asyncio.sleep(LATE_BY_S)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _spec() -> RunSpec:
    rollout = {
        "group_size": 2,
        "groups_per_step": GROUPS_PER_STEP,
        "oversample": 2,
        "filters": ["zero_variance"],
        "max_staleness": 0,
        "stale_groups": "downweight",
    }
    return resolve(json_format.ParseDict({"rollout": rollout}, RunSpec()))


async def _rollout(ctx: Any, request: GroupRequest) -> SampleGroup:
    """Solves the prompts at even positions (a mixed group: trained) and no other (all wrong: zero variance,
    filtered), every sample on weight version 0: stale from step 1 on, so each trained group is down-weighted."""
    solved = request.position % 2 == 0
    samples = [
        Sample(
            sample_id=f"{request.group_id}/{j}",
            index=j,
            prompt_token_ids=[1, 2],
            response_token_ids=[3],
            rollout_logprobs=[-0.5],
            loss_mask=[1],
            reward=float(j) if solved else 0.0,
            weight_versions=[0],
            status=SampleStatus.SAMPLE_STATUS_OK,
        )
        for j in range(2)
    ]
    prompt_id = f"train/{request.position}"
    return SampleGroup(group_id=request.group_id, run_id=RUN, prompt_id=prompt_id, samples=samples, weight=1.0)


class Orchestrator:
    """What one orchestrator producing steps of the run holds: its own data position (producer token), on `core`."""

    def __init__(self, core: Any, client: redis.Redis, prefix: str) -> None:
        spec = _spec()
        self.ctx = SimpleNamespace(spec=spec, rollout=_rollout, encode=list, render=str, context_tokens=0)
        self.data = RunData(LoadedDataset([Prompt(f"p{i}", str(i)) for i in range(100)], [], []), seed=1)
        filters = FilterRegistry({"zero_variance": zero_variance})
        self.deps = RunDeps(core, None, None, None, client, None, RolloutMetrics(), filters, None)  # type: ignore[arg-type]
        self.stream = SampleStream(client, RUN, prefix=prefix)
        self.position = DataPosition(client, RUN, prefix=prefix)

    async def produce(self, step: int) -> None:
        await _produce_step(self.ctx, self.deps, self.data, self.stream, self.position, RUN, step, 0)  # type: ignore[arg-type]


def _assert_each_step_counted_once(run: Run, steps: int) -> None:
    progress = run.progress
    assert progress.prompts_consumed == PROMPTS_PER_STEP * steps
    assert progress.groups_produced == GROUPS_PER_STEP * steps
    assert progress.groups_filtered == progress.prompts_consumed - progress.groups_produced, progress
    assert dict(progress.filtered_by_reason) == {"zero_variance": progress.groups_filtered}
    assert progress.groups_downweighted == GROUPS_PER_STEP * (steps - 1), progress  # step 0's groups are not stale


async def _new_run(core: RunsCore) -> None:
    await core.store.create(Run(id=RUN, spec=_spec(), state=RUNNING))


def test_a_progress_write_answered_late_counts_its_step_once(redis_client: redis.Redis, redis_prefix: str) -> None:
    proxy = LateExecReply()

    async def scenario() -> Run:
        async with (
            proxy.serving() as url,
            runs_core(redis_prefix, url=url, socket_timeout=SOCKET_TIMEOUT_S) as core,
        ):
            await _new_run(core)
            orchestrator = Orchestrator(core, redis_client, redis_prefix)
            await orchestrator.produce(0)
            proxy.armed = True
            await orchestrator.produce(1)
            return await core.get(RUN)

    run = asyncio.run(scenario())
    assert proxy.held_back == 1, "step 1's progress write was answered late"
    _assert_each_step_counted_once(run, steps=2)


def test_a_record_write_answered_late_is_applied_once(redis_prefix: str) -> None:
    """redis-py reports the late reply as WatchError, which the compare-and-set took for another writer's change."""
    proxy = LateExecReply()

    def add_one(run: Run) -> None:
        run.progress.groups_trained += 1

    async def scenario() -> Run:
        async with (
            proxy.serving() as url,
            runs_core(redis_prefix, url=url, socket_timeout=SOCKET_TIMEOUT_S) as core,
        ):
            await _new_run(core)
            proxy.armed = True
            await core.update(RUN, add_one)
            return await core.get(RUN)

    assert asyncio.run(scenario()).progress.groups_trained == 1
    assert proxy.held_back == 1


def test_a_cancel_answered_late_answers_the_run_cancelled_and_a_second_cancel_is_a_conflict(
    redis_prefix: str,
) -> None:
    """The store knows the late write as this Cancel's own; a second Cancel is still told the run is over."""
    proxy = LateExecReply()

    async def scenario() -> Run:
        async with (
            proxy.serving() as url,
            runs_core(redis_prefix, url=url, socket_timeout=SOCKET_TIMEOUT_S) as core,
        ):
            await _new_run(core)
            proxy.armed = True
            cancelled = await core.cancel(RUN)
            with pytest.raises(Conflict, match=f"^run {RUN} already CANCELLED: it cannot be cancelled$"):
                await core.cancel(RUN)
            return cancelled

    assert asyncio.run(scenario()).state == CANCELLED
    assert proxy.held_back == 1


class Killed(Exception):
    """The orchestrator died here."""


class DiesBeforeProgress:
    """The run's records as an orchestrator sees them that is killed as it writes a step's progress."""

    def __init__(self, core: RunsCore) -> None:
        self.get = core.get

    async def update(self, run_id: str, mutate: Callable[[Run], None], **_: Any) -> Run:
        raise Killed


@pytest.mark.parametrize("resumed_at", [1, 2], ids=["re-producing-the-step", "past-the-step"])
def test_a_step_whose_producer_died_before_its_progress_is_counted_by_the_next_orchestrator(
    redis_client: redis.Redis, redis_prefix: str, resumed_at: int
) -> None:
    """The first orchestrator records step 1's data position and appends its groups, then dies. The next one starts
    at the trainer's step: 1 (it re-produces the step), or 2 if the trainer has trained step 1 meanwhile."""

    async def scenario() -> Run:
        async with runs_core(redis_prefix) as core:
            await _new_run(core)
            first = Orchestrator(core, redis_client, redis_prefix)
            await first.produce(0)
            first.deps = dataclasses.replace(first.deps, core=DiesBeforeProgress(core))  # type: ignore[arg-type]
            with pytest.raises(Killed):
                await first.produce(1)
            restarted = Orchestrator(core, redis_client, redis_prefix)
            for step in range(resumed_at, 3):
                await restarted.produce(step)
            return await core.get(RUN)

    _assert_each_step_counted_once(asyncio.run(scenario()), steps=3)
