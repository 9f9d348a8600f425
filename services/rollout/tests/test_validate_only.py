"""Submit with validate_only (AIP-163) on a real orchestrator process, over REST and gRPC: every check of a
submit is made, a valid spec comes back resolved as the run it would create (QUEUED, no id) and nothing is
stored or counted, an invalid one gets the very error a submit gets, and a malformed flag is a 400 naming it.
`rlfleet submit --dry-run` against it prints a spec file that reads back as the resolved spec."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from rollout_test_support import Orchestrator, spec_json

from rlfleet.cli.main import main
from rlfleet.run_spec import resolve
from rlfleet.runs_client import load_spec_file
from rlfleet.v1.runs_pb2 import ListRunsRequest, RunSpec, RunState, SubmitRunRequest
from rlfleet.v1.runs_pb2_grpc import RunsStub

INVALID: list[tuple[str, dict[str, Any]]] = [
    ("a range run_spec.py checks", {"rollout": {"group_size": 1}}),
    ("no model where the orchestrator looks", {"model": {"path": "/nonexistent"}}),
    ("a reward function the hub does not know", {"reward": {"terms": [{"function": "nope"}]}}),
    ("a held-out split larger than the dataset's", {"dataset": {"arithmetic": {"digits": 1}, "eval_size": 5000}}),
]


def named(tokenizer_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A valid spec with a name no other test's run has, so the run list tells whether it was stored."""
    return spec_json(tokenizer_dir, name=f"validate-{uuid.uuid4().hex[:8]}", **overrides)


def stored_names(url: str) -> list[str]:
    runs = httpx.get(f"{url}/v1/runs", params={"page_size": 1000}, timeout=5).json()["runs"]
    return [run["spec"].get("name", "") for run in runs]


def runs_counted(url: str) -> float:
    """The sum of the runs-by-state gauge: a run moving between states leaves it as it was, a new run adds 1."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(value) for value in re.findall(r"^rlfleet_rollout_runs\{[^}]*\} (\S+)$", text, re.MULTILINE))


@pytest.fixture
def runs(orchestrator: Orchestrator) -> Iterator[RunsStub]:
    with grpc.insecure_channel(orchestrator.grpc_address) as channel:
        yield RunsStub(channel)


@pytest.mark.e2e
def test_rest_validate_only_answers_the_resolved_run_and_refuses_as_submit_does_storing_and_counting_nothing(
    orchestrator: Orchestrator, tokenizer_dir: Path
) -> None:
    spec = named(tokenizer_dir)
    counted = runs_counted(orchestrator.url)
    response = httpx.post(f"{orchestrator.url}/v1/runs", params={"validate_only": "true"}, json=spec, timeout=10)
    assert response.status_code == 200, response.text
    run = response.json()
    assert run["id"] == "" and "created_at" not in run
    assert run["state"] == "RUN_STATE_QUEUED"
    assert run["progress"]["total_steps"] == "3"
    assert json_format.ParseDict(run["spec"], RunSpec()) == resolve(json_format.ParseDict(spec, RunSpec()))
    assert run["spec"]["rollout"]["function"] == "single_turn"  # a default the spec left out
    assert spec["name"] not in stored_names(orchestrator.url)
    assert runs_counted(orchestrator.url) == counted

    for (why, overrides), flag in zip(INVALID, ["true", "1", "false", "0"], strict=True):
        bad = named(tokenizer_dir, **overrides)
        submitted = httpx.post(f"{orchestrator.url}/v1/runs", json=bad, timeout=10)
        validated = httpx.post(f"{orchestrator.url}/v1/runs", params={"validate_only": flag}, json=bad, timeout=10)
        assert submitted.status_code == 400, (why, submitted.text)
        assert (validated.status_code, validated.json()) == (submitted.status_code, submitted.json()), why


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("query", "named_param"),
    [
        ({"validate_only": "maybe"}, "validate_only"),
        ({"validate_only": ""}, "validate_only"),
        ({"validate_only": "2"}, "validate_only"),
        ({"validateOnly": "true"}, "validateOnly"),
        ([("validate_only", "true"), ("validate_only", "false")], "validate_only"),
    ],
)
def test_a_malformed_misspelt_or_doubled_validate_only_is_a_400_naming_it_and_nothing_is_stored(
    orchestrator: Orchestrator, tokenizer_dir: Path, query: Any, named_param: str
) -> None:
    spec = named(tokenizer_dir)
    response = httpx.post(f"{orchestrator.url}/v1/runs", params=query, json=spec, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["kind"] == "invalid_input"
    assert error["message"].startswith(f"query.{named_param}: "), error["message"]
    assert spec["name"] not in stored_names(orchestrator.url)


@pytest.mark.e2e
def test_grpc_validate_only_answers_the_resolved_run_and_refuses_as_submit_does(
    orchestrator: Orchestrator, runs: RunsStub, tokenizer_dir: Path
) -> None:
    spec = json_format.ParseDict(named(tokenizer_dir), RunSpec())
    run = runs.Submit(SubmitRunRequest(spec=spec, validate_only=True), timeout=10)
    assert (run.id, run.HasField("created_at")) == ("", False)
    assert run.state == RunState.RUN_STATE_QUEUED and run.progress.total_steps == 3
    assert run.spec == resolve(spec)
    assert spec.name not in [r.spec.name for r in runs.List(ListRunsRequest(page_size=1000), timeout=5).runs]

    for why, overrides in INVALID:
        bad = json_format.ParseDict(named(tokenizer_dir, **overrides), RunSpec())
        with pytest.raises(grpc.RpcError) as submitted:
            runs.Submit(SubmitRunRequest(spec=bad), timeout=10)
        with pytest.raises(grpc.RpcError) as validated:
            runs.Submit(SubmitRunRequest(spec=bad, validate_only=True), timeout=10)
        assert submitted.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
        assert (validated.value.code(), validated.value.details()) == (
            submitted.value.code(),
            submitted.value.details(),
        ), why


@pytest.mark.e2e
def test_rlfleet_submit_dry_run_prints_the_spec_the_orchestrator_resolved_and_fails_as_submit_does(
    orchestrator: Orchestrator, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = named(tokenizer_dir, dataset={"arithmetic": {"digits": 1, "ops": "+"}, "seed": 7, "eval_size": 6})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert main(["submit", str(path), "--api", orchestrator.url, "--dry-run"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_spec_file(printed) == resolve(json_format.ParseDict(spec, RunSpec()))
    assert spec["name"] not in stored_names(orchestrator.url)

    path.write_text(json.dumps({**spec, "model": {"path": "/nonexistent"}}))
    outcomes = []
    for dry_run in ([], ["--dry-run"]):
        code = main(["submit", str(path), "--api", orchestrator.url, *dry_run])
        outcomes.append((code, *capsys.readouterr()))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][:2] == (2, "") and outcomes[0][2].startswith("rlfleet: error: HTTP 400: model.path: ")
