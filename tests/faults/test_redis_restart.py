"""Redis, the fleet's memory, crashes and comes back from its append-only file in the middle of a run:
the run completes and its stream, pending groups and records come back whole, and no service exits:
their Redis clients retry through the outage (`rlfleet.sample_stream.connect_redis`). The fleet runs its own
redis-server for this (the shared Redis of the other tests is never touched)."""

from __future__ import annotations

import time

import pytest

from rlfleet.local_fleet import LocalFleet
from rlfleet.sample_stream import REDIS_RETRY_BUDGET_S

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.faults]

OUTAGE_S = 2.0


def test_redis_killed_and_restarted_from_aof(fault_fleet: LocalFleet, runs) -> None:
    redis_process = fault_fleet.processes["redis"]
    services = {name: fault_fleet.processes[name] for name in ("rollout", "trainer")}

    def crash_redis() -> None:
        redis_process.kill()
        time.sleep(OUTAGE_S)
        fault_fleet.restart("redis")

    runs.survive("Redis SIGKILL + restart from AOF", crash_redis)
    assert fault_fleet.processes["redis"] is not redis_process, "Redis was not restarted"
    for name, process in services.items():
        assert fault_fleet.processes[name] is process and process.alive(), (
            f"{name} exited during the Redis outage instead of waiting it out; see {process.log_path}"
        )
    recovery = runs.figures[-1]["recovery_s"]
    assert isinstance(recovery, float) and recovery < REDIS_RETRY_BUDGET_S, (
        f"recovery took {recovery}s, longer than the Redis clients' retry budget"
    )
