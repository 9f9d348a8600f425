"""Short runs through the real orchestrator and the fake fleet: file datasets, filters that refill a step,
the staleness bound, evaluation with k samples, and a restart that continues the data position."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import datasets as hf_datasets
import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from rollout_test_support import (
    FakeFleet,
    Orchestrator,
    spec_json,
    start_fake_fleet,
    start_orchestrator,
    wait_for_state,
    wait_until,
)

from rlfleet.v1.samples_pb2 import SampleGroup

TRAIN = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a} for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3)]]
HELD_OUT = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a} for a in (1, 3, 4)]  # none a training prompt


def _write(kind: str, rows: list[dict], path: Path) -> str:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        hf_datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def _file_dataset(kind: str, tmp_path: Path) -> dict[str, Any]:
    source = {
        "path": _write(kind, TRAIN, tmp_path / f"train.{kind}"),
        "eval_path": _write(kind, HELD_OUT, tmp_path / f"eval.{kind}"),
        "metadata_columns": ["level"],
    }
    return {kind: source, "seed": 3, "eval_size": 3}


def _run(url: str, spec: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/runs", json=spec, timeout=10)
    assert response.status_code == 200, response.text
    final = wait_for_state(url, response.json()["id"], {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout)
    assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
    return final


def _trained(fleet: FakeFleet, run_id: str) -> list[tuple[int, SampleGroup]]:
    return fleet.trainer.runs[run_id].trained


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk"])
def test_file_datasets_run_a_short_job_over_two_epochs(
    kind: str, orchestrator: Orchestrator, fleet: FakeFleet, tokenizer_dir: Path, tmp_path: Path
) -> None:
    final = _run(orchestrator.url, spec_json(tokenizer_dir, dataset=_file_dataset(kind, tmp_path)))
    assert final["progress"]["prompts_consumed"] == "6" and final["progress"]["epoch"] == "1"  # 6 prompts of 5
    groups = [g for _, g in _trained(fleet, final["id"])]
    assert len(groups) == 6 and {g.samples[0].prompt_text for g in groups} == {r["prompt"] for r in TRAIN}
    assert {g.metadata["level"] for g in groups} <= {str(r["level"]) for r in TRAIN}
    assert all(s.seed for g in groups for s in g.samples)  # per-sample seeds, sent as sampling_seed
    assert {s.seed for g in groups for s in g.samples} <= set(fleet.router_seeds)
    assert [e["size"] for e in final["evals"]] == [3, 3, 3]


@pytest.mark.e2e
def test_zero_variance_groups_are_refilled_and_counted(
    orchestrator: Orchestrator, fleet: FakeFleet, tokenizer_dir: Path
) -> None:
    spec = spec_json(
        tokenizer_dir,
        rollout={
            "group_size": 4,
            "groups_per_step": 2,
            "sampling": {"max_new_tokens": 4},
            "filters": ["zero_variance"],
            "max_prompts_per_step": 40,
        },
        schedule={"steps": 3, "eval_every": 2, "eval_samples": 4},
    )
    final = _run(orchestrator.url, spec)
    run_id, progress = final["id"], final["progress"]
    trained = [g for _, g in _trained(fleet, run_id)]
    assert [g.group_id for g in trained] == [f"{run_id}/{s}/{i}" for s in range(3) for i in range(2)]
    assert all(statistics.pvariance([s.reward for s in g.samples]) > 0 for g in trained)
    filtered = int(progress["groups_filtered"])
    assert filtered > 0 and {k: int(v) for k, v in progress["filtered_by_reason"].items()} == {
        "zero_variance": filtered
    }
    assert int(progress["prompts_consumed"]) == 6 + filtered
    assert all(e["k"] == 4 and e["pass_at_k"] >= e["accuracy"] for e in final["evals"])
    metrics = httpx.get(f"{orchestrator.url}/metrics", timeout=5).text
    assert f'rlfleet_rollout_groups_filtered_total{{reason="zero_variance"}} {float(filtered)}' in metrics
    # Every reason's series exists from the start, so a first filtered group shows in rate() and increase().
    assert 'rlfleet_rollout_groups_filtered_total{reason="stale"} 0.0' in metrics
    assert "rlfleet_rollout_eval_pass_at_k " in metrics and "rlfleet_rollout_eval_truncation_rate " in metrics


@pytest.mark.e2e
def test_staleness_bound_holds_and_lagging_groups_are_down_weighted(
    orchestrator: Orchestrator, fleet: FakeFleet, tokenizer_dir: Path
) -> None:
    counted = _staleness_counted(orchestrator.url)
    rollout = {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}, "max_staleness": 1}
    final = _run(orchestrator.url, spec_json(tokenizer_dir, rollout=rollout, schedule={"steps": 4}))
    ages = [step - min(v for s in g.samples for v in s.weight_versions) for step, g in _trained(fleet, final["id"])]
    assert len(ages) == 8 and max(ages) <= 1
    fleet.router_lag[0] = 1  # the engines serve one version behind the trainer
    try:
        rollout = {**rollout, "max_staleness": 0, "stale_groups": "downweight", "stale_weight": 0.25}
        final = _run(orchestrator.url, spec_json(tokenizer_dir, rollout=rollout))
    finally:
        fleet.router_lag[0] = 0
    weights = [(step, g.weight) for step, g in _trained(fleet, final["id"])]
    assert weights == [(0, 1.0), (0, 1.0), (1, 0.25), (1, 0.25), (2, 0.25), (2, 0.25)]
    assert final["progress"]["groups_downweighted"] == "4"
    # The lag of every group appended, as the dashboard charts it: the first run's, then 0, 0, 1, 1, 1, 1.
    count, total = _staleness_counted(orchestrator.url)
    assert (count - counted[0], total - counted[1]) == (14, sum(ages) + 4)


def _staleness_counted(url: str) -> tuple[float, float]:
    """The orchestrator's rlfleet_rollout_group_staleness: (groups observed, their lags summed)."""
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    value = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("rlfleet_rollout_group_")}
    return value["rlfleet_rollout_group_staleness_count"], value["rlfleet_rollout_group_staleness_sum"]


@pytest.mark.e2e
def test_a_restarted_orchestrator_continues_the_data_position(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    fleet = start_fake_fleet(redis_client, redis_prefix)
    first = second = None
    try:
        first = start_orchestrator(fleet, tmp_path / "first.log")
        fleet.trainer.paused.set()
        rollout = {"group_size": 2, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}, "max_staleness": 1}
        spec = spec_json(tokenizer_dir, dataset=_file_dataset("jsonl", tmp_path), rollout=rollout)
        spec["schedule"] = {"steps": 5}
        run_id = httpx.post(f"{first.url}/v1/runs", json=spec, timeout=10).json()["id"]

        def produced() -> str:
            return httpx.get(f"{first.url}/v1/runs/{run_id}", timeout=5).json()["progress"]["groups_produced"]

        wait_until(lambda: produced() == "4", 20, "steps 0 and 1 produced")
        # Shutdown cancels the run where it waits for the paused trainer, however often a Redis command drops
        # the cancellation (concurrency.py); the run stays RUNNING for the next orchestrator.
        assert first.process.stop(timeout=40) == 0, first.process.log_tail()
        second = start_orchestrator(fleet, tmp_path / "second.log")
        fleet.trainer.paused.clear()
        final = wait_for_state(second.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
        assert final["state"] == "RUN_STATE_SUCCEEDED", (
            f"{final.get('error')}\n{fleet.trainer.describe(run_id)}\n"
            f"first orchestrator:\n{first.process.log_tail()}\nsecond orchestrator:\n{second.process.log_tail()}"
        )
        groups = [g for _, g in fleet.trainer.runs[run_id].trained]
        assert [int(g.prompt_id.removeprefix("train/")) for g in groups] == list(range(10))
        prompts = [g.samples[0].prompt_text for g in groups]
        train = sorted(str(r["prompt"]) for r in TRAIN)
        assert sorted(prompts[:5]) == train and sorted(prompts[5:]) == train  # each epoch: every prompt once
    finally:
        for orch in (first, second):
            if orch is not None:
                orch.process.stop(timeout=15)
        fleet.stop()
