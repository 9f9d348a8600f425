"""An orchestrator that stops mid-run is replaced by a new process, which resumes the RUNNING run from
the trainer's step without writing any group twice; a trainer that forgot the run is started again. Two
orchestrators on one Redis never drive a run together: the one that holds its lease does, and the other
takes it over once that one dies and its lease runs out."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis
from redis_partition import RedisPartition
from rollout_test_support import (
    REDIS_URL,
    spec_json,
    start_fake_fleet,
    start_orchestrator,
    wait_for_state,
    wait_until,
)

from rlfleet.sample_stream import REDIS_RETRY_BUDGET_S, SampleStream


def _run(url: str, run_id: str) -> dict:
    return httpx.get(f"{url}/v1/runs/{run_id}", timeout=5).json()


@pytest.mark.e2e
def test_a_new_orchestrator_resumes_a_running_run_without_duplicating_groups(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    fleet = start_fake_fleet(redis_client, redis_prefix)
    first = second = None
    try:
        first = start_orchestrator(fleet, tmp_path / "first.log")
        fleet.trainer.paused.set()
        run_id = httpx.post(f"{first.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        wait_until(lambda: _run(first.url, run_id)["progress"]["groups_produced"] == "2", 20, "step 0 produced")
        assert first.process.stop(timeout=15) == 0, first.process.log_tail()
        assert _run_state(redis_client, redis_prefix, run_id) == "RUNNING"  # shutdown is not a cancel
        stream = SampleStream(redis_client, run_id, prefix=redis_prefix)
        assert stream.length() == 2

        second = start_orchestrator(fleet, tmp_path / "second.log")
        # The new process starts the trainer again and re-produces step 0, which the stream already holds.
        wait_until(lambda: fleet.trainer.start_calls.count(run_id) == 2, 20, "StartRun from the new orchestrator")
        time.sleep(0.5)
        assert stream.length() == 2
        # A trainer that restarted answers NOT_FOUND; the orchestrator starts the run on it again.
        fleet.trainer.runs[run_id].known = False
        wait_until(lambda: fleet.trainer.start_calls.count(run_id) == 3, 20, "StartRun after NOT_FOUND")

        fleet.trainer.paused.clear()
        final = wait_for_state(second.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
        assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
        expected = [f"{run_id}/{s}/{i}" for s in range(3) for i in range(2)]
        assert fleet.trainer.runs[run_id].trained_group_ids == expected
        assert stream.length() == len(expected)
        assert [int(e["step"]) for e in final["evals"]] == [0, 2, 3]  # step 0 was not evaluated twice
    finally:
        for orch in (first, second):
            if orch is not None:
                orch.process.stop(timeout=15)
        fleet.stop()


@pytest.mark.e2e
def test_two_orchestrators_on_one_redis_drive_a_run_one_at_a_time(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The review's case: both queues picked the run (two StartRun, two producers, two evaluations)."""
    fleet = start_fake_fleet(redis_client, redis_prefix)
    env = {"RLFLEET_ROLLOUT_RUN_LEASE_S": "2"}
    orchestrators = []
    try:
        for log in (tmp_path / "a.log", tmp_path / "b.log"):
            orchestrators.append((start_orchestrator(fleet, log, env=env), log))
        fleet.trainer.paused.set()
        url = orchestrators[0][0].url
        run_id = httpx.post(f"{url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        wait_until(lambda: _run(url, run_id)["progress"].get("groups_produced") == "2", 20, "step 0 produced")

        def skipping() -> list[int]:
            return [i for i, (_, log) in enumerate(orchestrators) if f"run {run_id} is driven by" in log.read_text()]

        wait_until(lambda: len(skipping()) == 1, 15, "the other orchestrator to leave the run to the first")
        assert fleet.trainer.start_calls == [run_id]
        driver, other = orchestrators[1 - skipping()[0]][0], orchestrators[skipping()[0]][0]
        assert "starts at step 0" in orchestrators[1 - skipping()[0]][1].read_text()

        driver.process.kill()  # its lease is left to run out
        wait_until(lambda: fleet.trainer.start_calls.count(run_id) == 2, 15, "the other orchestrator to take over")
        fleet.trainer.paused.clear()
        final = wait_for_state(other.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
        assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
        assert fleet.trainer.runs[run_id].trained_group_ids == [f"{run_id}/{s}/{i}" for s in range(3) for i in range(2)]
    finally:
        for orch, _ in orchestrators:
            if orch.process.alive():
                orch.process.stop(timeout=15)
        fleet.stop()


@pytest.mark.e2e
def test_a_run_cancelled_while_its_dead_drivers_lease_runs_is_stopped_on_the_trainer(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Its driver would have stopped the trainer; killed, it never does, and the orchestrator that answered the
    Cancel left the run (its lease was another's) and never asked: the trainer trained the cancelled run on."""
    fleet = start_fake_fleet(redis_client, redis_prefix)
    first = second = None
    try:
        first = start_orchestrator(fleet, tmp_path / "first.log")
        fleet.trainer.paused.set()
        run_id = httpx.post(f"{first.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        wait_until(lambda: run_id in fleet.trainer.start_calls, 20, "StartRun")
        first.process.kill()  # its lease on the run runs on for its 15 s
        second = start_orchestrator(fleet, tmp_path / "second.log")
        cancel = httpx.post(f"{second.url}/v1/runs/{run_id}:cancel", timeout=10)
        assert cancel.status_code == 200 and cancel.json()["state"] == "RUN_STATE_CANCELLED", cancel.text
        wait_until(lambda: run_id in fleet.trainer.stop_calls, 10, "StopRun of the cancelled run")
        # Logged once the StopRun is answered, a moment after the trainer saw it.
        wait_until(lambda: "the trainer was freed from run" in second.process.log_tail(), 10, "the release logged")
    finally:
        fleet.trainer.paused.clear()
        for orch in (first, second):
            if orch is not None:
                orch.process.stop(timeout=15)
        fleet.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_an_orchestrator_cut_off_redis_past_its_retries_leaves_the_run_to_the_one_that_took_it_over(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A partition between the driving orchestrator and Redis, longer than the Redis client's retries. Before, its
    lease renewal waited on those retries while the other orchestrator took the run over; the first drove on, met
    the outage, and once Redis answered again recorded FAILED ("Redis was unreachable for longer than 30s") over the
    run the other was driving. Now it stops driving once its lease is all but out, and the run succeeds."""
    fleet = start_fake_fleet(redis_client, redis_prefix)
    partition = RedisPartition(REDIS_URL)
    env = {"RLFLEET_ROLLOUT_RUN_LEASE_S": "2", "RLFLEET_ROLLOUT_STEP_TIMEOUT_S": "300"}
    first = second = None
    try:
        first = start_orchestrator(
            fleet, tmp_path / "first.log", env={**env, "RLFLEET_ROLLOUT_REDIS_URL": partition.url}
        )
        fleet.trainer.paused.set()
        run_id = httpx.post(f"{first.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        wait_until(
            lambda: "starts at step 0" in (tmp_path / "first.log").read_text(), 20, "the first orchestrator to drive"
        )
        second = start_orchestrator(fleet, tmp_path / "second.log", env=env)
        wait_until(
            lambda: f"run {run_id} is driven by" in (tmp_path / "second.log").read_text(), 20, "the second to leave it"
        )

        partition.cut()
        wait_until(lambda: fleet.trainer.start_calls.count(run_id) == 2, 15, "the second to take the run over")
        time.sleep(REDIS_RETRY_BUDGET_S + 12)  # the first's Redis client gives up (10 s socket timeout on top)
        assert "this one stops driving it" in (tmp_path / "first.log").read_text(), "it drove on, cut off"
        partition.heal()
        time.sleep(5)  # what the first would write once Redis answers again
        assert _run(second.url, run_id)["state"] == "RUN_STATE_RUNNING", _run(second.url, run_id).get("error")

        fleet.trainer.paused.clear()
        final = wait_for_state(second.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
        assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
        assert fleet.trainer.runs[run_id].trained_group_ids == [f"{run_id}/{s}/{i}" for s in range(3) for i in range(2)]
    finally:
        fleet.trainer.paused.clear()
        partition.heal()
        for orch in (first, second):
            if orch is not None and orch.process.alive():
                orch.process.stop(timeout=15)
        partition.close()
        fleet.stop()


def _run_state(client: redis.Redis, prefix: str, run_id: str) -> str:
    from rlfleet.v1.runs_pb2 import Run, RunState

    run = Run.FromString(client.get(f"{prefix}run:{run_id}:record"))
    return RunState.Name(run.state).removeprefix("RUN_STATE_")
