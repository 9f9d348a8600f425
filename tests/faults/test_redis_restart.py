"""Redis, the fleet's memory, crashes and comes back from its append-only file in the middle of a run:
the run completes and its stream, pending groups and records come back whole. The fleet runs its own
redis-server for this (the shared Redis of the other tests is never touched)."""

from __future__ import annotations

import time

import pytest

from rlfleet.local_fleet import LocalFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.faults]

OUTAGE_S = 2.0


def test_redis_killed_and_restarted_from_aof(fault_fleet: LocalFleet, runs) -> None:
    redis_process = fault_fleet.processes["redis"]

    def crash_redis() -> None:
        redis_process.kill()
        time.sleep(OUTAGE_S)
        fault_fleet.restart("redis")

    runs.survive("Redis SIGKILL + restart from AOF", crash_redis)
