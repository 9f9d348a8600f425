"""What the tests of the orchestrator's conversation with the trainer share: a trainer servicer served in
process, the Runs core on the real Redis, a TrainerSession over both, and the run loop's dependencies around
a trainer that only answers StopRun."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis.asyncio as aioredis
from grpc import aio
from rollout_test_support import REDIS_URL

from rlfleet.errors import Conflict, Unavailable
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec, RunState
from rlfleet.v1.trainer_pb2 import TrainerState, TrainerStatus
from rlfleet_rollout.config import RolloutConfig
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_loop import RunDeps
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
async def runs_core(
    prefix: str, url: str = REDIS_URL, *, poll_interval_s: float = 0.1, **client_options: Any
) -> AsyncIterator[RunsCore]:
    """The Runs core over the Redis at `url` (the real one by default) under `prefix` (its reward hub is never
    asked: nothing is submitted), the API and the run loop sharing one client; `client_options` go to it."""
    client = aioredis.Redis.from_url(url, **{"socket_timeout": 5, **client_options})
    try:
        async with httpx.AsyncClient() as http:
            yield RunsCore(
                RunStore(client, prefix),
                RewardClient(http, "http://127.0.0.1:9", score_timeout_s=1, validate_timeout_s=1),
                RunNotifier(),
                RolloutMetrics(),
                filters=FilterRegistry({}),
                rollouts=RolloutRegistry.from_entry_points(),
                poll_interval_s=poll_interval_s,
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


class StopOnlyTrainer:
    """The trainer as the run loop sees it once the run is over: StopRun goes unanswered (UNAVAILABLE) the first
    `unreachable` times, then answers the trainer's final progress. Each call notes the run's recorded state
    then, and the first one tries a Cancel, as a user would while the run still looks alive."""

    def __init__(self, core: RunsCore, unreachable: int = 0) -> None:
        self.core = core
        self.unreachable = unreachable
        self.states_seen: list[str] = []
        self.cancel_answer = ""

    async def stop_run(self, run_id: str) -> TrainerStatus:
        self.states_seen.append(RunState.Name((await self.core.store.get(run_id)).state).removeprefix("RUN_STATE_"))
        if len(self.states_seen) == 1:
            try:
                self.cancel_answer = RunState.Name((await self.core.cancel(run_id)).state)
            except Conflict as exc:
                self.cancel_answer = f"Conflict: {exc}"
        if self.unreachable > 0:
            self.unreachable -= 1
            raise Unavailable("trainer StopRun failed: UNAVAILABLE: failed to connect to all addresses")
        return TrainerStatus(
            run_id=run_id, state=TrainerState.TRAINER_STATE_STOPPED, step=4, weight_version=4, groups_trained=8
        )


def run_deps(core: RunsCore, trainer: StopOnlyTrainer, *, step_timeout_s: float = 10) -> RunDeps:
    """What `execute_run` needs when its `_drive` is replaced: the core, the trainer and the step bound."""
    config = RolloutConfig(step_timeout_s=step_timeout_s, poll_interval_s=0.05)
    return RunDeps(
        core,
        trainer,
        None,
        None,
        None,
        config,
        core.metrics,
        core.filters,
        core.rollouts,  # type: ignore[arg-type]
    )
