"""A run spec too large for its Run to reach a gRPC client with the default 4 MiB receive limit is refused at submit,
alike over gRPC and REST, naming its size, the limit, its largest part and where such data belongs; the largest spec
taken reads back through Get, List and Watch on a channel with gRPC's default limits. A real orchestrator process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from rollout_test_support import Orchestrator, spec_json

from rlfleet.v1.runs_pb2 import (
    CancelRunRequest,
    GetRunRequest,
    ListRunsRequest,
    RunSpec,
    RunState,
    SubmitRunRequest,
    WatchRunRequest,
)
from rlfleet.v1.runs_pb2_grpc import RunsStub
from rlfleet_rollout.spec_size import MAX_SPEC_BYTES

MIB = 1024 * 1024


@pytest.fixture
def runs(orchestrator: Orchestrator) -> Iterator[RunsStub]:
    """A client with gRPC's default limits (it receives at most 4 MiB), as grpcurl and generated clients have."""
    with grpc.insecure_channel(orchestrator.grpc_address) as channel:
        yield RunsStub(channel)


def _with_rubric(tokenizer_dir: Path, name: str, rubric_bytes: int) -> dict[str, Any]:
    """A valid spec whose reward term carries a `rubric` param of `rubric_bytes` characters; its run has more steps
    than a test lasts, so a test that submits it cancels it rather than finding it ended."""
    terms = [{"function": "arith_exact", "params": {"rubric": "x" * rubric_bytes}}]
    return spec_json(tokenizer_dir, name=name, reward={"terms": terms}, schedule={"steps": 10_000})


def _names(runs: RunsStub) -> list[str]:
    """The names of every stored run, page by page."""
    names, token = [], ""
    while True:
        page = runs.List(ListRunsRequest(page_size=1000, page_token=token), timeout=10)
        names += [run.spec.name for run in page.runs]
        token = page.next_page_token
        if not token:
            return names


def _says_what_to_do(message: str) -> None:
    assert "5.00 MiB" in message, message
    assert "at most 1 MiB" in message and "4 MiB a gRPC client receives by default" in message, message
    assert "largest part: reward.terms[0].params.rubric (5.00 MiB)" in message, message
    assert "dataset" in message and "metadata_columns" in message, message


@pytest.mark.e2e
def test_a_spec_whose_run_a_default_grpc_client_could_not_read_is_refused(runs: RunsStub, tokenizer_dir: Path) -> None:
    """Before: the server took it (its limit is 16 MiB) and stored the run, but Submit's answer, the Run with the spec,
    passed the 4 MiB the client receives: RESOURCE_EXHAUSTED on the client's side for a run that was stored, and no
    Get, List or Watch of it (nor a List of the runs around it) could be read either."""
    spec = json_format.ParseDict(_with_rubric(tokenizer_dir, "too-large", 5 * MIB), RunSpec())
    for validate_only in (False, True):
        with pytest.raises(grpc.RpcError) as refused:
            runs.Submit(SubmitRunRequest(spec=spec, validate_only=validate_only), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        _says_what_to_do(refused.value.details())
    assert "too-large" not in _names(runs)


@pytest.mark.e2e
def test_such_a_spec_is_refused_alike_over_rest(
    orchestrator: Orchestrator, runs: RunsStub, tokenizer_dir: Path
) -> None:
    """Before: stored (200), and then its run reached no gRPC client with the default limits, nor did a List of the
    runs around it."""
    body = _with_rubric(tokenizer_dir, "too-large-rest", 5 * MIB)
    for query in ({}, {"validate_only": "true"}):
        response = httpx.post(f"{orchestrator.url}/v1/runs", params=query, json=body, timeout=30)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["kind"] == "invalid_input"
        _says_what_to_do(error["message"])
    assert "too-large-rest" not in _names(runs)


@pytest.mark.e2e
def test_the_largest_spec_taken_reads_back_through_a_default_grpc_client(
    orchestrator: Orchestrator, runs: RunsStub, tokenizer_dir: Path
) -> None:
    base = json_format.ParseDict(_with_rubric(tokenizer_dir, "largest", 0), RunSpec())
    # The rubric that brings the spec, as stored (defaults filled in), just under the limit.
    resolved = runs.Submit(SubmitRunRequest(spec=base, validate_only=True), timeout=30).spec.ByteSize()
    spec = json_format.ParseDict(_with_rubric(tokenizer_dir, "largest", MAX_SPEC_BYTES - resolved - 16), RunSpec())
    run = runs.Submit(SubmitRunRequest(spec=spec), timeout=30)
    try:
        assert MAX_SPEC_BYTES - 64 < run.spec.ByteSize() <= MAX_SPEC_BYTES
        assert runs.Get(GetRunRequest(id=run.id), timeout=10).spec == run.spec
        assert "largest" in _names(runs)
        first = next(runs.Watch(WatchRunRequest(id=run.id), timeout=30))
        assert first.run.id == run.id
        rest = httpx.get(f"{orchestrator.url}/v1/runs/{run.id}", timeout=10)
        assert rest.status_code == 200 and rest.json()["spec"]["name"] == "largest"
    finally:
        cancelled = runs.Cancel(CancelRunRequest(id=run.id), timeout=10)
        assert cancelled.state == RunState.RUN_STATE_CANCELLED
