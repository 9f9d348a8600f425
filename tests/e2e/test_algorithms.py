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


def spec_for(fleet: LocalFleet, name: str, algorithm: dict, trainer: dict) -> RunSpec:
    spec = {
        "name": name,
        "model": {"path": str(fleet.config.model_path)},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 4},
        "rollout": {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "algorithm": algorithm,
        "trainer": {"learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1, **trainer},
        "schedule": {"steps": STEPS},
    }
    return json_format.ParseDict(spec, RunSpec())


def train_to_the_end(fleet: LocalFleet, api: RunsClient, spec: RunSpec) -> list[trainer_pb2.StepReport]:
    """Submits `spec`, waits for it to succeed, and returns the trainer's report of every step."""
    run = api.wait_final(api.submit(spec).id, timeout_s=120)
    assert run.state == RunState.RUN_STATE_SUCCEEDED, run.error
    assert run.progress.step == STEPS and run.progress.weight_version == STEPS
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.trainer_grpc}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        reports = list(stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id=run.id, from_step=1), timeout=30))
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    for report in reports:
        assert all(math.isfinite(v) for v in report.metrics.values()), dict(report.metrics)
        assert report.metrics["grad_norm"] > 0
    return reports


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_runs_end_to_end(fleet: LocalFleet, api: RunsClient, name: str) -> None:
    # A KL term exercises the reference model, in the loss or in the reward as the algorithm has it.
    algorithm = {"name": name, "kl_coef": 0.01, "entropy_coef": 0.001}
    reports = train_to_the_end(fleet, api, spec_for(fleet, f"algo-{name}", algorithm, {}))
    for report in reports:
        assert report.metrics["logprob_diff"] < 1e-3  # packed training log-probs match the engines'
        assert report.metrics["optimizer_updates"] == 1
    assert ("value_loss" in reports[-1].metrics) == (name == "ppo")


def test_ppo_with_mini_batches_and_epochs_takes_every_update_through_the_fleet(
    fleet: LocalFleet, api: RunsClient
) -> None:
    """The spec's trainer.mini_batches and trainer.epochs reach the trainer under torchrun: 2 x 2 updates a step,
    each clipped against the log-probs before the step (TIS), the critic stepping with them."""
    # The fleet's untrained model gets equal rewards (no advantage): the entropy bonus gives the updates a gradient.
    algorithm = {"name": "ppo", "tis_cap": 2.0, "kl_coef": 0.01, "entropy_coef": 0.001}
    reports = train_to_the_end(fleet, api, spec_for(fleet, "algo-ppo-2x2", algorithm, {"mini_batches": 2, "epochs": 2}))
    for report in reports:
        assert report.metrics["optimizer_updates"] == 4 and report.metrics["update_skipped"] == 0
        assert "value_loss" in report.metrics and "tis_weight" in report.metrics
