"""The fault suite's fleet and its ledger check.

One fleet serves every fault case: real processes on free ports with a Redis of its own (AOF on, in
a temp dir), so the Redis case restarts that one and never the shared Redis of the other tests.
Deadlines are tightened to the scale of a tiny model (a dead or hung engine is noticed within
seconds, a proxied request gives up after 15 s instead of 10 minutes): every recovery time measured
here is bounded by these settings, and docs/reliability.md states them next to the figures.

After each case the fleet is made whole again (dead services restarted, stopped ones continued,
unfinished runs cancelled), so one failing case cannot cascade into the next.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import httpx
import pytest
from google.protobuf import json_format

from rlfleet.errors import RlfleetError
from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.processes import free_port
from rlfleet.runs_client import FINAL_STATES, RunsClient
from rlfleet.sample_stream import SampleStream, connect_redis
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState

ENGINES = 2
STEPS, GROUPS_PER_STEP, GROUP_SIZE = 8, 4, 4
FAULT_STEP = 3
"""Faults are injected once the run has completed this many steps."""

REWARD_MODEL_PORT = free_port()
"""Where the slow-reward case serves its reward model: the hub calls only URLs its operator listed, at start."""

# Deadlines at the scale of a tiny model on two cores; production defaults are minutes.
FAULT_FLEET_ENV = {
    "RLFLEET_REWARD_REMOTE_URL_PREFIXES": f'["http://127.0.0.1:{REWARD_MODEL_PORT}/score"]',
    "RLFLEET_ROUTER_HEALTH_CHECK_INTERVAL_SECS": "1",
    "RLFLEET_ROUTER_HEALTH_CHECK_TIMEOUT_SECS": "3",
    "RLFLEET_ROUTER_HEALTH_FAILURE_THRESHOLD": "2",
    "RLFLEET_ROUTER_REQUEST_TIMEOUT_SECS": "15",
    "RLFLEET_ROUTER_WEIGHT_UPDATE_TIMEOUT_SECS": "30",
    "RLFLEET_ROLLOUT_GENERATE_TIMEOUT_S": "60",
    "RLFLEET_ROLLOUT_SCORE_TIMEOUT_S": "60",
    "RLFLEET_ROLLOUT_STEP_TIMEOUT_S": "150",
    "RLFLEET_ROLLOUT_POLL_INTERVAL_S": "0.5",
    "RLFLEET_ROLLOUT_RUN_LEASE_S": "4",
    "RLFLEET_TRAINER_WEIGHT_LOAD_TIMEOUT_S": "120",
}

FAULT_FIGURE = "fault_figure"
"""The test report property under which a case records what it measured; the root conftest prints them."""


@dataclass(frozen=True)
class Ledger:
    """Where every group of a finished run went."""

    prompts: int
    trained: int
    filtered: int
    by_reason: dict[str, int]


class FaultRuns:
    """Submits runs to the fault fleet, watches them through outages, checks their ledger, and records
    what each case measured in its test report (the root conftest prints them at the end of the session;
    docs/reliability.md quotes them)."""

    def __init__(self, fleet: LocalFleet, report_properties: list[tuple[str, object]]) -> None:
        self.fleet = fleet
        self.api = RunsClient(fleet.api_url, timeout_s=10)
        self.report_properties = report_properties
        self.submitted: list[str] = []

    @property
    def figures(self) -> list[dict[str, object]]:
        """What this test's cases measured, in order."""
        return [cast(dict[str, object], value) for name, value in self.report_properties if name == FAULT_FIGURE]

    def survive(self, case: str, inject: Callable[[], None], spec: RunSpec | None = None) -> tuple[Run, Ledger]:
        """Runs `spec` (the default spec when None), calls `inject` once FAULT_STEP steps are done, and
        checks that the run completes with its ledger balanced. Recovery is the time from the fault
        to the first step completed after it."""
        run_id = self.submit(spec or self.spec(case))
        self.wait_step(run_id, FAULT_STEP)
        step_at_fault = self.get(run_id).progress.step
        fault_at = time.monotonic()
        inject()
        recovered_at = self.wait_step(run_id, step_at_fault + 1, timeout=240)
        run = self.wait_final(run_id)
        ledger = self.assert_ledger_balanced(run)
        seconds = run.finished_at.ToSeconds() - run.started_at.ToSeconds()
        self.report_properties.append(
            (
                FAULT_FIGURE,
                {
                    "case": case,
                    "recovery_s": round(recovered_at - fault_at, 1),
                    "step_s": round(seconds / run.spec.schedule.steps, 1),
                    "run_s": round(seconds, 1),
                    "trained": ledger.trained,
                    "filtered": ledger.filtered,
                    "reasons": ledger.by_reason,
                },
            )
        )
        return run, ledger

    def spec(self, name: str, **rollout: object) -> RunSpec:
        body = {
            "name": name,
            "model": {"path": str(self.fleet.config.model_path)},
            "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 4, "seed": 7},
            "rollout": {
                "group_size": GROUP_SIZE,
                "groups_per_step": GROUPS_PER_STEP,
                "sampling": {"max_new_tokens": 4},
                # A group the fault left with a failed sample is replaced, and counted under this reason.
                "filters": ["any_failed"],
                **rollout,
            },
            "reward": {"terms": [{"function": "arith_exact"}]},
            "trainer": {"learning_rate": 1e-3, "seed": 7},
            "schedule": {"steps": STEPS},
        }
        return json_format.ParseDict(body, RunSpec())

    def submit(self, spec: RunSpec) -> str:
        run_id = self.api.submit(spec).id
        self.submitted.append(run_id)
        return run_id

    def get(self, run_id: str, timeout: float = 60.0) -> Run:
        """The run, waiting (bounded) while the Runs API is down, e.g. its orchestrator restarting."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.api.get(run_id)
            except RlfleetError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def wait_step(self, run_id: str, step: int, timeout: float = 120.0) -> float:
        """Waits until the run has completed `step` steps; returns when that was seen (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.get(run_id)
            assert run.state not in FINAL_STATES, f"run {run_id} ended before step {step}: {run.error}"
            if run.progress.step >= step:
                return time.monotonic()
            time.sleep(0.2)
        raise AssertionError(f"run {run_id} did not reach step {step} within {timeout:.0f}s")

    def wait_final(self, run_id: str, timeout: float = 300.0) -> Run:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.get(run_id)
            if run.state in FINAL_STATES:
                return run
            time.sleep(0.5)
        raise AssertionError(f"run {run_id} did not finish within {timeout:.0f}s: {self.get(run_id)}")

    def assert_ledger_balanced(self, run: Run) -> Ledger:
        """The run succeeded and every group is accounted for once: each prompt taken produced one
        group, which was either trained (on the stream once, acknowledged) or filtered with a reason."""
        assert run.state == RunState.RUN_STATE_SUCCEEDED, f"run {run.id} ended {RunState.Name(run.state)}: {run.error}"
        steps, per_step = run.spec.schedule.steps, run.spec.rollout.groups_per_step
        expected = steps * per_step
        config = self.fleet.config
        client = connect_redis(config.resolved_redis_url())
        try:
            stream = SampleStream(client, run.id, prefix=config.redis_prefix)
            # Each group id is appended once (the append is idempotent per id); the trained ones are trimmed.
            group_ids = {raw.decode() for raw in cast(set[bytes], client.smembers(stream.ids_key))}
            trainer_count = client.hget(f"{config.redis_prefix}run:{run.id}:trainer", "groups_trained")
            pending, dead, left = stream.pending_count(), stream.dead_letters(), stream.length()
        finally:
            client.close()
        slots = {f"{run.id}/{s}/{i}" for s in range(steps) for i in range(per_step)}
        assert group_ids == slots, f"missing {slots - group_ids}, unexpected {group_ids - slots}"
        assert pending == 0, f"{pending} group(s) still pending on the trainer's consumer group"
        assert left == 0, f"{left} group(s) left on the stream after the last checkpoint"
        assert dead == [], f"groups moved to dead letters: {dead}"
        assert trainer_count is not None and int(trainer_count) == expected, f"trainer trained {trainer_count!r}"
        progress = run.progress
        assert progress.groups_trained == expected and progress.groups_produced == expected, progress
        by_reason = dict(progress.filtered_by_reason)
        assert all(reason and count > 0 for reason, count in by_reason.items()), by_reason
        assert progress.groups_filtered == sum(by_reason.values()), progress
        assert progress.prompts_consumed == expected + progress.groups_filtered, (
            f"{progress.prompts_consumed} prompts taken, {expected} groups trained + "
            f"{progress.groups_filtered} filtered {by_reason}"
        )
        return Ledger(int(progress.prompts_consumed), expected, int(progress.groups_filtered), by_reason)


@pytest.fixture(scope="package")
def fault_fleet(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Iterator[LocalFleet]:
    """The fleet of the fault cases, with a redis-server of its own on a free port (AOF on)."""
    config = FleetConfig(
        model_path=small_model_dir,
        engines=ENGINES,
        state_dir=tmp_path_factory.mktemp("fault-fleet"),
        ports=replace(FleetPorts.free(ENGINES), redis=free_port()),
        redis_prefix=f"rlfleet-faults:{uuid.uuid4().hex[:8]}:",
        startup_timeout_s=120,
        env=FAULT_FLEET_ENV,
    )
    with LocalFleet(config) as running:
        assert "redis" in running.processes, "the fault fleet must run its own redis-server"
        yield running


@pytest.fixture
def reward_model_port() -> int:
    """The port the fault fleet's reward hub may call a reward model at (RLFLEET_REWARD_REMOTE_URL_PREFIXES)."""
    return REWARD_MODEL_PORT


@pytest.fixture
def runs(fault_fleet: LocalFleet, request: pytest.FixtureRequest) -> Iterator[FaultRuns]:
    runs = FaultRuns(fault_fleet, request.node.user_properties)
    yield runs
    restore(fault_fleet, runs)
    runs.api.close()


def restore(fleet: LocalFleet, runs: FaultRuns) -> None:
    """Makes the fleet whole for the next case: every process running and answering, both engines in
    routing, no run left unfinished. A run that did not succeed may still hold the trainer (a StartRun
    the orchestrator gave up on completes anyway), so the trainer is started afresh after one."""
    for name, process in list(fleet.processes.items()):
        if process.alive():
            os.killpg(process.pid, signal.SIGCONT)
        else:
            fleet.restart(name)
    states = {run_id: runs.get(run_id).state for run_id in runs.submitted}
    for run_id, state in states.items():
        if state not in FINAL_STATES:
            runs.api.cancel(run_id)
    if any(state != RunState.RUN_STATE_SUCCEEDED for state in states.values()):
        fleet.restart("trainer")
    wait_engines_routed(fleet, ENGINES)


def wait_engines_routed(fleet: LocalFleet, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    healthy = -1
    while time.monotonic() < deadline:
        try:
            healthy = int(httpx.get(f"{fleet.router_url}/fleet", timeout=5).json()["healthy"])
        except httpx.HTTPError:
            healthy = -1
        if healthy >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"{healthy} of {count} engines in routing after {timeout:.0f}s")
