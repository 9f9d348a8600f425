"""Submit in the transport-free core: a reward hub that cannot be asked makes Submit Unavailable, and
nothing is stored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format
from rollout_test_support import REDIS_URL, spec_json

from rlfleet.errors import Unavailable
from rlfleet.processes import free_port
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore


def test_submit_with_the_reward_hub_down_is_unavailable_and_stores_nothing(
    redis_prefix: str, tokenizer_dir: Path
) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        async with httpx.AsyncClient() as http:
            hub = RewardClient(http, f"http://127.0.0.1:{free_port()}", score_timeout_s=1, list_timeout_s=0.5)
            store = RunStore(client, redis_prefix)
            core = RunsCore(
                store,
                hub,
                RunNotifier(),
                RolloutMetrics(),
                filters=FilterRegistry({}),
                rollouts=RolloutRegistry.from_entry_points(),
                poll_interval_s=0.1,
            )
            with pytest.raises(Unavailable, match="/functions"):
                await core.submit(json_format.ParseDict(spec_json(tokenizer_dir), RunSpec()))
            assert await store.page() == ([], "")
        await client.aclose()

    asyncio.run(scenario())
