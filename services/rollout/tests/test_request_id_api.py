"""Submit's request_id over REST (`POST /v1/runs?request_id=`) and gRPC (`SubmitRunRequest.request_id`) on a real
orchestrator process: a repeat answers the first Submit's run, concurrent Submits of one request_id make one run,
another spec under it is 409 / ALREADY_EXISTS naming it, and a malformed, empty or doubled request_id is 400 /
INVALID_ARGUMENT naming it, with nothing stored."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from rollout_test_support import Orchestrator, spec_json

from rlfleet.v1.runs_pb2 import RunSpec, SubmitRunRequest
from rlfleet.v1.runs_pb2_grpc import RunsStub


def named(tokenizer_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A valid spec with a name no other test's run has, so the run list tells how many of it were stored."""
    return spec_json(tokenizer_dir, name=f"request-id-{uuid.uuid4().hex[:8]}", **overrides)


def stored_ids(url: str, name: str) -> list[str]:
    runs = httpx.get(f"{url}/v1/runs", params={"page_size": 1000}, timeout=5).json()["runs"]
    return [run["id"] for run in runs if run["spec"].get("name") == name]


@pytest.fixture
def cancel_afterwards(orchestrator: Orchestrator) -> Iterator[list[str]]:
    """Run ids to cancel at the end, so the session's other tests do not queue behind them."""
    ids: list[str] = []
    yield ids
    for run_id in ids:
        httpx.post(f"{orchestrator.url}/v1/runs/{run_id}:cancel", timeout=5)  # 409 once it ended: fine


@pytest.fixture
def runs(orchestrator: Orchestrator) -> Iterator[RunsStub]:
    with grpc.insecure_channel(orchestrator.grpc_address) as channel:
        yield RunsStub(channel)


@pytest.mark.e2e
def test_rest_a_repeated_or_concurrent_submit_of_one_request_id_makes_one_run(
    orchestrator: Orchestrator, tokenizer_dir: Path, cancel_afterwards: list[str]
) -> None:
    spec, request_id = named(tokenizer_dir), str(uuid.uuid4())

    def post() -> httpx.Response:
        return httpx.post(f"{orchestrator.url}/v1/runs", params={"request_id": request_id}, json=spec, timeout=30)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post(), range(6)))
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    cancel_afterwards.extend(ids)
    assert post().json()["id"] in ids
    assert stored_ids(orchestrator.url, spec["name"]) == list(ids)

    other = httpx.post(
        f"{orchestrator.url}/v1/runs",
        params={"request_id": request_id},
        json={**spec, "schedule": {"steps": 4}},
        timeout=30,
    )
    assert other.status_code == 409, other.text
    error = other.json()["error"]
    assert error["kind"] == "already_exists"
    assert error["message"].startswith(f"request_id: {request_id!r} was already used by a Submit of another spec")
    assert stored_ids(orchestrator.url, spec["name"]) == list(ids)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"request_id": "x" * 65}, "request_id: 65 characters, at most 64"),
        ({"request_id": "not a uuid!"}, "request_id: 'not a uuid!' holds a character other than"),
        ({"request_id": ""}, "query.request_id: empty"),
        ([("request_id", "a"), ("request_id", "a")], "query.request_id: given more than once"),
        ({"requestId": "a"}, "query.requestId: not a parameter of POST /v1/runs (it takes validate_only, request_id)"),
        ({"request_id": "a/b", "validate_only": "true"}, "request_id: 'a/b' holds a character"),
    ],
)
def test_rest_a_malformed_empty_doubled_or_misspelt_request_id_is_a_400_naming_it(
    orchestrator: Orchestrator, tokenizer_dir: Path, query: Any, message: str
) -> None:
    spec = named(tokenizer_dir)
    response = httpx.post(f"{orchestrator.url}/v1/runs", params=query, json=spec, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(message), response.text
    assert stored_ids(orchestrator.url, spec["name"]) == []


@pytest.mark.e2e
def test_grpc_a_repeated_submit_of_one_request_id_makes_one_run_and_another_spec_is_already_exists(
    orchestrator: Orchestrator, runs: RunsStub, tokenizer_dir: Path, cancel_afterwards: list[str]
) -> None:
    spec_dict, request_id = named(tokenizer_dir), str(uuid.uuid4())
    spec = json_format.ParseDict(spec_dict, RunSpec())
    first = runs.Submit(SubmitRunRequest(spec=spec, request_id=request_id), timeout=30)
    cancel_afterwards.append(first.id)
    assert runs.Submit(SubmitRunRequest(spec=spec, request_id=request_id), timeout=30).id == first.id
    # The request_id is one across transports: the same spec over REST is the same Submit.
    rest = httpx.post(f"{orchestrator.url}/v1/runs", params={"request_id": request_id}, json=spec_dict, timeout=30)
    assert rest.json()["id"] == first.id
    assert stored_ids(orchestrator.url, spec.name) == [first.id]

    other = RunSpec()
    other.CopyFrom(spec)
    other.schedule.steps = 4
    with pytest.raises(grpc.RpcError) as refused:
        runs.Submit(SubmitRunRequest(spec=other, request_id=request_id), timeout=30)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert refused.value.details().startswith(f"request_id: {request_id!r} was already used")

    for bad in ("x" * 65, "two words"):
        with pytest.raises(grpc.RpcError) as malformed:
            runs.Submit(SubmitRunRequest(spec=spec, request_id=bad), timeout=30)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert malformed.value.details().startswith("request_id: ")
    assert stored_ids(orchestrator.url, spec.name) == [first.id]
