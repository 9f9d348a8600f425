"""Every registered algorithm runs the arithmetic task end to end through a real fleet (engines,
router, reward hub, trainer under torchrun, orchestrator): two steps each, tiny batches."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf import json_format

from rlfleet.local_fleet import LocalFleet
from rlfleet.run_spec import ALGORITHMS
from rlfleet.runs_client import RunsClient
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec, RunState

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 2


@pytest.fixture(scope="module")
def api(fleet: LocalFleet) -> RunsClient:
    return RunsClient(fleet.api_url, timeout_s=30)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_runs_end_to_end(fleet: LocalFleet, api: RunsClient, name: str) -> None:
    spec = {
        "name": f"algo-{name}",
        "model": {"path": str(fleet.config.model_path)},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 4},
        "rollout": {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        # A KL term exercises the reference model, in the loss or in the reward as the algorithm has it.
        "algorithm": {"name": name, "kl_coef": 0.01, "entropy_coef": 0.001},
        "trainer": {"learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1},
        "schedule": {"steps": STEPS},
    }
    run = api.wait_final(api.submit(json_format.ParseDict(spec, RunSpec())).id, timeout_s=120)
    assert run.state == RunState.RUN_STATE_SUCCEEDED, run.error
    assert run.progress.step == STEPS and run.progress.weight_version == STEPS
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.trainer_grpc}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        reports = list(stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id=run.id, from_step=1), timeout=30))
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    for report in reports:
        assert all(math.isfinite(v) for v in report.metrics.values()), dict(report.metrics)
        assert report.metrics["grad_norm"] > 0
        assert report.metrics["logprob_diff"] < 1e-3  # packed training log-probs match the engines'
    assert ("value_loss" in reports[-1].metrics) == (name == "ppo")
