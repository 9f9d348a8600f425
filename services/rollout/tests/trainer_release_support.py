"""What the tests of the orchestrator's conversation with the trainer share: a trainer servicer served in
process, the Runs core on the real Redis, and a TrainerSession over both."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import redis.asyncio as aioredis
from grpc import aio
from rollout_test_support import REDIS_URL

from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import TrainerStatus
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore
from rlfleet_rollout.trainer_client import TrainerClient
from rlfleet_rollout.trainer_release import TrainerRelease
from rlfleet_rollout.trainer_session import TrainerSession


@contextlib.asynccontextmanager
async def serve_trainer(
    servicer: trainer_pb2_grpc.TrainerServicer, *, call_timeout_s: float = 5, start_timeout_s: float = 10
) -> AsyncIterator[TrainerClient]:
    """`servicer` on a free loopback port, and a client of it with these deadlines."""
    server = aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = TrainerClient(f"127.0.0.1:{port}", call_timeout_s=call_timeout_s, start_timeout_s=start_timeout_s)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(grace=None)


@contextlib.asynccontextmanager
async def runs_core(prefix: str) -> AsyncIterator[RunsCore]:
    """The Runs core over the real Redis under `prefix` (its reward hub is never asked: nothing is submitted)."""
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        async with httpx.AsyncClient() as http:
            yield RunsCore(
                RunStore(client, prefix),
                RewardClient(http, "http://127.0.0.1:9", score_timeout_s=1, validate_timeout_s=1),
                RunNotifier(),
                RolloutMetrics(),
                filters=FilterRegistry({}),
                rollouts=RolloutRegistry.from_entry_points(),
                poll_interval_s=0.1,
                run_data_retention_s=60,
            )
    finally:
        await client.aclose()


async def _no_status(status: TrainerStatus) -> None:
    return None


def session(
    client: TrainerClient, core: RunsCore, run_id: str, *, step_timeout_s: float = 10, poll_interval_s: float = 0.1
) -> TrainerSession:
    """The run loop's session for `run_id`; stops are retried within `step_timeout_s`, first after `poll_interval_s`."""
    release = TrainerRelease(client, core, within_s=step_timeout_s, first_pause_s=poll_interval_s)
    return TrainerSession(
        client,
        run_id,
        RunSpec(),
        step_timeout_s=step_timeout_s,
        poll_interval_s=poll_interval_s,
        on_status=_no_status,
        release=release,
    )
