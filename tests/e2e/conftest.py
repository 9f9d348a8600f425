"""One real fleet (engines, router, reward hub, trainer under torchrun, orchestrator) per module,
on free ports, with its own Redis key prefix; stopped by pid and its keys deleted afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.sample_stream import connect_redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Iterator[LocalFleet]:
    prefix = f"rlfleet-e2e:{uuid.uuid4().hex[:10]}:"
    config = FleetConfig(
        model_path=small_model_dir,
        engines=2,
        state_dir=tmp_path_factory.mktemp("fleet"),
        ports=FleetPorts.free(2),
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        startup_timeout_s=120,
    )
    with LocalFleet(config) as running:
        yield running
    client = connect_redis(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        client.delete(*keys)
    client.close()
