"""The trainer sharded over two torchrun ranks (FSDP2 over gloo) trains a run end to end through a
real fleet, checkpoints it on every rank, and hands each version to the engines by broadcast over a
weight update group (weight_sync=distributed), with the engines' log-probs matching the trainer's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import json_format

from rlfleet.local_fleet import LocalFleet
from rlfleet.runs_client import RunsClient
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec, RunState

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3


@pytest.fixture(scope="module")
def sharded_fleet(
    fleet_factory: Callable[..., AbstractContextManager[LocalFleet]], small_model_dir: Path
) -> Iterator[LocalFleet]:
    with fleet_factory(
        small_model_dir, engines=1, trainer_ranks=2, env={"RLFLEET_TRAINER_WEIGHT_SYNC": "distributed"}
    ) as running:
        yield running


def test_two_rank_trainer_trains_checkpoints_and_broadcasts(sharded_fleet: LocalFleet) -> None:
    fleet = sharded_fleet
    metrics = httpx.get(f"{fleet.url(fleet.config.ports.trainer_http)}/metrics", timeout=10).text
    assert "rlfleet_trainer_ranks 2.0" in metrics
    api = RunsClient(fleet.api_url, timeout_s=30)
    spec = {
        "name": "sharded",
        "model": {"path": str(fleet.config.model_path)},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 4},
        "rollout": {"group_size": 4, "groups_per_step": 3, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "algorithm": {"name": "grpo", "kl_coef": 0.01, "entropy_coef": 0.001},
        "trainer": {"learning_rate": 1e-3, "checkpoint_every": 1},
        "schedule": {"steps": STEPS},
    }
    run_id = api.submit(json_format.ParseDict(spec, RunSpec())).id
    run = api.wait_final(run_id, timeout_s=180)
    assert run.state == RunState.RUN_STATE_SUCCEEDED, run.error
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.trainer_grpc}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        reports = list(stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id=run_id, from_step=1), timeout=30))
        status = stub.Status(trainer_pb2.StatusRequest(run_id=run_id), timeout=10)
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    for report in reports:
        assert report.metrics["grad_norm"] > 0
        # Sharded training scores the samples as the engines did: the broadcast weights are the trained ones.
        assert report.metrics["logprob_diff"] < 1e-3, dict(report.metrics)
    assert status.checkpoint_step == STEPS and Path(status.checkpoint_path, ".metadata").exists()
    # Every rank wrote its shards of the checkpoint.
    shards = sorted(p.name for p in Path(status.checkpoint_path).glob("*.distcp"))
    assert len(shards) >= 2, shards
    info = httpx.get(f"{fleet.engine_urls()[0]}/get_model_info", timeout=10).json()
    assert str(info["weight_version"]) == str(STEPS)
    sync = httpx.get(f"{fleet.router_url}/metrics", timeout=10).text
    assert 'rlfleet_router_weight_sync_seconds_count{path="distributed"}' in sync
