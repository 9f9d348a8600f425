"""An engine that hangs (SIGSTOP: the kernel still accepts its connections, nothing ever answers)
in the middle of a run: the router's health checks take it out of routing, the requests it held move
to another engine at that moment (under their rids), a weight update in flight stops waiting for it,
and the run completes without it."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from rlfleet.local_fleet import LocalFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.faults]


def test_hung_engine_is_routed_around(fault_fleet: LocalFleet, runs) -> None:
    engine = fault_fleet.processes["engine-1"]
    try:
        runs.survive("hung engine (SIGSTOP)", lambda: os.killpg(engine.pid, signal.SIGSTOP))
        workers = httpx.get(f"{fault_fleet.router_url}/workers", timeout=5).json()["workers"]
        hung = [w for w in workers if w["url"] == fault_fleet.engine_urls()[1]]
        assert hung and not hung[0]["healthy"], f"the hung engine is still in routing: {workers}"
        # Once its health checks take it out, a weight update stops waiting for it and the requests it held
        # move to another engine: recovery is bounded by the health checks (2 x 3 s timeouts) and a step; a
        # weight update that waited for the engine would take its whole timeout (30 s).
        recovery = runs.figures[-1]["recovery_s"]
        update_timeout = float(fault_fleet.config.env["RLFLEET_ROUTER_WEIGHT_UPDATE_TIMEOUT_SECS"])
        assert isinstance(recovery, float) and recovery < update_timeout, (
            f"recovery took {recovery}s: a weight update waited for the hung engine"
        )
    finally:
        os.killpg(engine.pid, signal.SIGCONT)
