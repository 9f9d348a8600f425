"""The orchestrator across real processes: killed with SIGKILL mid-run and started again, the run
completes with every prompt of each epoch used once and no SampleGroup twice on the stream; with
max_staleness 1 no group is trained by a policy more than one version newer than the one that
generated it (read back from the stream and the trainer's step reports)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from rlfleet.local_fleet import LocalFleet
from rlfleet.runs_client import FINAL_STATES, RunsClient
from rlfleet.sample_stream import SampleStream, connect_redis
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState
from rlfleet.v1.samples_pb2 import SampleGroup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GROUPS_PER_STEP = 2
# A checkpoint trims the groups it trained from the stream; these tests read them back.
# A killed orchestrator's lease on its run runs out in 4 s (15 s by default) before its restart takes the run.
FLEET_ENV = {"RLFLEET_TRAINER_KEEP_TRAINED_GROUPS": "true", "RLFLEET_ROLLOUT_RUN_LEASE_S": "4"}


@pytest.fixture(scope="module")
def api(fleet: LocalFleet) -> RunsClient:
    return RunsClient(fleet.api_url, timeout_s=30)


def _spec(fleet: LocalFleet, name: str, steps: int, dataset: dict, **rollout: object) -> RunSpec:
    spec = {
        "name": name,
        "model": {"path": str(fleet.config.model_path)},
        "dataset": dataset,
        "rollout": {"group_size": 4, "groups_per_step": GROUPS_PER_STEP, "sampling": {"max_new_tokens": 4}, **rollout},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "trainer": {"learning_rate": 1e-3},
        "schedule": {"steps": steps},
    }
    return json_format.ParseDict(spec, RunSpec())


def _wait(api: RunsClient, run_id: str, done: object, what: str, timeout: float = 180.0) -> Run:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = api.get(run_id)
        if done(run):  # type: ignore[operator]
            return run
        time.sleep(0.1)
    raise AssertionError(f"run {run_id}: timed out waiting for {what}: {api.get(run_id)}")


def _stream_groups(fleet: LocalFleet, run_id: str) -> tuple[list[SampleGroup], SampleStream]:
    client = connect_redis(fleet.config.resolved_redis_url())
    stream = SampleStream(client, run_id, prefix=fleet.config.redis_prefix)
    return [entry.group for entry in stream.entries()], stream


def _step_reports(fleet: LocalFleet, run_id: str) -> list[trainer_pb2.StepReport]:
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.trainer_grpc}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        return list(stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id=run_id, from_step=1), timeout=30))


def test_an_orchestrator_killed_mid_run_resumes_with_every_prompt_once(
    fleet: LocalFleet, api: RunsClient, tmp_path: Path
) -> None:
    rows = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(10, 15)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    steps = 6  # 12 prompts: two epochs of the 5 rows and two prompts of the third
    dataset = {"jsonl": {"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "eval.jsonl")}, "seed": 3}
    run = api.submit(_spec(fleet, "sigkill", steps, dataset))

    client = connect_redis(fleet.config.resolved_redis_url())
    stream = SampleStream(client, run.id, prefix=fleet.config.redis_prefix)
    deadline = time.monotonic() + 120
    while stream.appended_count() < 3:  # inside step 1, or just past it
        assert time.monotonic() < deadline, f"the run produced no groups: {api.get(run.id)}"
        time.sleep(0.02)
    fleet.processes["rollout"].kill()
    killed_at = stream.appended_count()
    client.close()
    fleet.restart("rollout")

    final = _wait(api, run.id, lambda r: r.state in FINAL_STATES, "the run to end")
    assert final.state == RunState.RUN_STATE_SUCCEEDED, final.error
    assert killed_at < steps * GROUPS_PER_STEP, "the orchestrator was killed after the run had produced everything"

    groups, stream = _stream_groups(fleet, run.id)
    ids = [g.group_id for g in groups]
    assert sorted(ids) == sorted(f"{run.id}/{s}/{i}" for s in range(steps) for i in range(GROUPS_PER_STEP))
    assert len(set(ids)) == len(ids)
    positions = [int(g.prompt_id.removeprefix("train/")) for g in groups]
    assert sorted(positions) == list(range(steps * GROUPS_PER_STEP))  # each position once, none skipped
    prompt_of = {int(g.prompt_id.removeprefix("train/")): g.samples[0].prompt_text for g in groups}
    every_prompt = sorted(r["prompt"] for r in rows)
    for epoch in range(2):
        assert sorted(prompt_of[p] for p in range(5 * epoch, 5 * epoch + 5)) == every_prompt
    third = [prompt_of[p] for p in range(10, 12)]
    assert len(set(third)) == 2
    assert stream.pending_count() == 0
    assert final.progress.groups_trained == steps * GROUPS_PER_STEP
    assert final.progress.epoch == 2 and final.progress.prompts_consumed == steps * GROUPS_PER_STEP


def test_with_max_staleness_1_no_trained_group_is_more_than_one_version_old(fleet: LocalFleet, api: RunsClient) -> None:
    steps = 5
    dataset = {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 4}
    run = api.submit(_spec(fleet, "stale-1", steps, dataset, max_staleness=1))
    final = _wait(api, run.id, lambda r: r.state in FINAL_STATES, "the run to end")
    assert final.state == RunState.RUN_STATE_SUCCEEDED, final.error

    groups, _ = _stream_groups(fleet, run.id)
    reports = _step_reports(fleet, run.id)
    # The trainer reads the stream in order, groups_per_step at a time: report k trained entries of batch k - 1.
    assert [(r.step, r.groups) for r in reports] == [(k, GROUPS_PER_STEP) for k in range(1, steps + 1)]
    lags: Counter[int] = Counter()
    for index, group in enumerate(groups):
        trained_by = reports[index // GROUPS_PER_STEP].weight_version - 1  # the policy the step started from
        oldest = min(v for s in group.samples for v in s.weight_versions)
        assert 0 <= trained_by - oldest <= 1, (
            group.group_id,
            trained_by,
            [list(s.weight_versions) for s in group.samples],
        )
        lags[trained_by - oldest] += 1
    assert sum(lags.values()) == steps * GROUPS_PER_STEP
