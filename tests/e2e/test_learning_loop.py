"""The learning loop across real processes: runs submitted with curl and over gRPC complete,
`rlfleet watch` shows progress, cancel stops a run, every group is trained on exactly once, and a
trainer killed mid-run resumes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import json_format

from rlfleet.local_fleet import LocalFleet
from rlfleet.runs_client import FINAL_STATES, RunsClient
from rlfleet.sample_stream import SampleStream, connect_redis
from rlfleet.v1 import runs_pb2, runs_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, GROUPS_PER_STEP = 3, 2


def spec_dict(fleet: LocalFleet, steps: int = STEPS, name: str = "e2e") -> dict:
    return {
        "name": name,
        "model": {"path": str(fleet.config.model_path)},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 8},
        "rollout": {"group_size": 4, "groups_per_step": GROUPS_PER_STEP, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "trainer": {"learning_rate": 1e-3},
        "schedule": {"steps": steps},
    }


def wait_step(client: RunsClient, run_id: str, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.get(run_id)
        assert run.state not in FINAL_STATES, f"run ended early: {run.error}"
        if run.progress.step >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} did not reach step {step}")


def assert_trained_exactly_once(fleet: LocalFleet, run: Run) -> None:
    """Every group written to the run's stream was trained on once, acknowledged and trimmed."""
    client = connect_redis(fleet.config.resolved_redis_url())
    stream = SampleStream(client, run.id, prefix=fleet.config.redis_prefix)
    expected = run.spec.schedule.steps * run.spec.rollout.groups_per_step
    assert stream.appended_count() == expected
    assert stream.pending_count() == 0
    assert stream.length() == 0, "the last checkpoint trims every group it acknowledged"
    assert stream.dead_letters() == []
    trained = client.hget(f"{fleet.config.redis_prefix}run:{run.id}:trainer", "groups_trained")
    assert trained is not None and int(trained) == expected
    assert run.progress.groups_trained == expected
    client.close()


@pytest.fixture(scope="module")
def api(fleet: LocalFleet) -> RunsClient:
    return RunsClient(fleet.api_url, timeout_s=30)


def trainer_reports(fleet: LocalFleet, run_id: str) -> list[trainer_pb2.StepReport]:
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.trainer_grpc}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        return list(stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id=run_id, from_step=1), timeout=30))


def test_run_submitted_with_curl_completes(fleet: LocalFleet, api: RunsClient, tmp_path: Path) -> None:
    body = tmp_path / "spec.json"
    body.write_text(json.dumps(spec_dict(fleet, name="curl")))
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "30",
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "--data",
            f"@{body}",
            f"{fleet.api_url}/v1/runs",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    submitted = json_format.Parse(out.stdout, Run(), ignore_unknown_fields=True)
    assert submitted.state in (RunState.RUN_STATE_QUEUED, RunState.RUN_STATE_RUNNING)
    run = api.wait_final(submitted.id, timeout_s=240)
    assert run.state == RunState.RUN_STATE_SUCCEEDED, run.error
    assert run.progress.step == STEPS and run.progress.weight_version == STEPS
    assert [e.step for e in run.evals][0] == 0 and run.evals[-1].step == STEPS
    assert_trained_exactly_once(fleet, run)
    # Train/inference agreement: same fp32 weights on both sides, so log-probs agree closely.
    reports = trainer_reports(fleet, run.id)
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    assert all(r.metrics["logprob_diff"] < 1e-3 for r in reports), [r.metrics["logprob_diff"] for r in reports]

    watched = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "watch", submitted.id, "--api", fleet.api_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert watched.returncode == 0, watched.stderr
    assert f"step {STEPS}/{STEPS}" in watched.stdout and "succeeded" in watched.stdout


def test_run_submitted_over_grpc_completes_and_is_watched(fleet: LocalFleet, api: RunsClient) -> None:
    spec = json_format.ParseDict(spec_dict(fleet, name="grpc"), RunSpec())
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.rollout_grpc}") as channel:
        stub = runs_pb2_grpc.RunsStub(channel)
        run = stub.Submit(runs_pb2.SubmitRunRequest(spec=spec), timeout=30)
        steps_seen = set()
        final = None
        for event in stub.Watch(runs_pb2.WatchRunRequest(id=run.id), timeout=240):
            steps_seen.add(event.run.progress.step)
            final = event.run
            if event.run.state in FINAL_STATES:
                break
    assert final is not None and final.state == RunState.RUN_STATE_SUCCEEDED, final
    assert set(range(STEPS + 1)) <= steps_seen  # the watch saw every step go by
    assert_trained_exactly_once(fleet, api.get(run.id))


def test_cancel_stops_a_run(fleet: LocalFleet, api: RunsClient) -> None:
    run = api.submit(json_format.ParseDict(spec_dict(fleet, steps=200, name="cancel"), RunSpec()))
    wait_step(api, run.id, 1)
    cancelled = api.cancel(run.id)
    assert cancelled.state == RunState.RUN_STATE_CANCELLED
    final = api.wait_final(run.id, timeout_s=60)
    assert final.state == RunState.RUN_STATE_CANCELLED
    client = connect_redis(fleet.config.resolved_redis_url())
    stream = SampleStream(client, run.id, prefix=fleet.config.redis_prefix)
    length = stream.appended_count()
    time.sleep(3)
    assert stream.appended_count() == length, "groups are still being produced after cancel"
    assert length < 200 * GROUPS_PER_STEP
    client.close()


def test_trainer_killed_mid_run_resumes_and_nothing_is_lost(fleet: LocalFleet, api: RunsClient) -> None:
    run = api.submit(json_format.ParseDict(spec_dict(fleet, steps=6, name="kill"), RunSpec()))
    wait_step(api, run.id, 2)
    fleet.processes["trainer"].kill()  # SIGKILL to torchrun's process group, mid-run
    health = f"{fleet.url(fleet.config.ports.trainer_http)}/health"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the rank dies with its launcher: nothing answers any more
        try:
            httpx.get(health, timeout=1)
        except httpx.TransportError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the trainer rank survived its killed launcher")
    fleet.restart("trainer")
    final = api.wait_final(run.id, timeout_s=240)
    assert final.state == RunState.RUN_STATE_SUCCEEDED, final.error
    assert final.progress.weight_version == 6
    assert_trained_exactly_once(fleet, final)
