"""The hub as a real process: HTTP and gRPC on loopback, time limits, bad input, metrics, shutdown."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import json_format

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.e2e

LAUNCHER = Path(__file__).resolve().parent / "reward_hub_for_tests.py"
MAX_BATCH = 16
MAX_BYTES = 100_000
MAX_PENDING_JOBS = 24  # a full batch of two terms (32 jobs) is taken only by an idle hub
ADMISSION_WAIT_SECONDS = 0.3
JSON_BODY = {"content-type": "application/json"}


class Hub:
    def __init__(self, tmp: Path, name: str) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        argv = [
            sys.executable, str(LAUNCHER), "--host", "127.0.0.1", "--port", str(self.port),
            "--grpc-port", str(self.grpc_port), "--workers", "2", "--max-batch-size", str(MAX_BATCH),
            "--max-request-bytes", str(MAX_BYTES), "--shutdown-grace-seconds", "2",
            "--max-pending-jobs", str(MAX_PENDING_JOBS), "--admission-wait-seconds", str(ADMISSION_WAIT_SECONDS),
        ]  # fmt: skip
        self.process = ServiceProcess(name, argv, tmp / f"{name}.log", env={"RLFLEET_LOG_FORMAT": "text"})
        self.url = f"http://127.0.0.1:{self.port}"
        self.process.wait_healthy(f"{self.url}/health", timeout=30)

    def score(self, body: object, timeout: float = 10) -> httpx.Response:
        return httpx.post(f"{self.url}/score", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    started = Hub(tmp_path_factory.mktemp("reward"), "reward-hub")
    try:
        yield started
    finally:
        started.process.stop(timeout=10)


@pytest.fixture(scope="module")
def stub(hub: Hub) -> Iterator[reward_pb2_grpc.RewardStub]:
    with grpc.insecure_channel(f"127.0.0.1:{hub.grpc_port}") as channel:
        yield reward_pb2_grpc.RewardStub(channel)


def arith_request(items: list[dict], **spec: object) -> dict:
    return {"spec": {"terms": [{"function": "arith_exact"}], **spec}, "items": items}


def test_score_over_http(hub: Hub) -> None:
    body = {
        "spec": {"terms": [{"function": "arith_exact", "weight": 0.5}, {"function": "math"}]},
        "items": [
            {"id": "a", "prompt": "37+45=", "response": "82\n", "label": "82"},
            {"id": "b", "prompt": "37+45=", "response": "81", "label": "82"},
        ],
    }
    response = hub.score(body)
    assert response.status_code == 200, response.text
    right, wrong = response.json()["results"]
    assert right["id"] == "a" and right["status"] == "SCORE_STATUS_OK"
    assert right["score"] == 1.5
    assert right["components"] == {"arith_exact": 1.0, "math": 1.0}
    # Zero values are present, not omitted.
    assert wrong["score"] == 0.0 and wrong["error"] == ""
    assert wrong["components"] == {"arith_exact": 0.0, "math": 0.0}
    functions = httpx.get(f"{hub.url}/functions", timeout=10).json()["functions"]
    assert {"arith_exact", "math", "hang"} <= {f["name"] for f in functions}


def test_score_over_grpc(stub: reward_pb2_grpc.RewardStub) -> None:
    request = reward_pb2.ScoreRequest(
        spec=reward_pb2.RewardSpec(terms=[reward_pb2.RewardTerm(function="arith_exact", weight=2.0)]),
        items=[reward_pb2.ScoreItem(id=str(i), response=str(i), label="3") for i in range(5)],
    )
    response = stub.Score(request, timeout=10)
    assert [r.id for r in response.results] == ["0", "1", "2", "3", "4"]
    assert [r.score for r in response.results] == [0.0, 0.0, 0.0, 2.0, 0.0]
    assert all(r.status == reward_pb2.SCORE_STATUS_OK for r in response.results)
    names = [f.name for f in stub.ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=10).functions]
    assert "math" in names


def test_validate_names_what_score_would_refuse_over_both_transports(
    hub: Hub, stub: reward_pb2_grpc.RewardStub
) -> None:
    spec = {
        "terms": [{"function": "exact", "params": {"bogus": 1}}, {"function": "arith_exact"}],
        "timeout_seconds": 1e9,
    }
    response = httpx.post(f"{hub.url}/validate", json={"spec": spec}, timeout=10)
    assert response.status_code == 200, response.text
    problems = response.json()["problems"]
    assert [p["field"] for p in problems] == ["terms[0].params.bogus", "timeout_seconds"]
    assert problems[1]["message"] == "must be > 0 and <= 300, got 1000000000.0"
    good = {"spec": {"terms": [{"function": "exact", "params": {"strip": False}}]}}
    assert httpx.post(f"{hub.url}/validate", json=good, timeout=10).json() == {"problems": []}
    refused = httpx.post(f"{hub.url}/validate", json={"spec": {"terms": "exact"}}, timeout=10)
    assert refused.status_code == 400 and "invalid ValidateSpecRequest" in refused.json()["error"]["message"]
    request = json_format.ParseDict({"spec": spec}, reward_pb2.ValidateSpecRequest())
    over_grpc = stub.ValidateSpec(request, timeout=10)
    assert [(p.field, p.message) for p in over_grpc.problems] == [(p["field"], p["message"]) for p in problems]


def test_a_hang_comes_back_timeout_within_its_limit_and_the_hub_keeps_serving(
    hub: Hub, stub: reward_pb2_grpc.RewardStub
) -> None:
    body = {
        "spec": {"terms": [{"function": "hang_on_label"}], "timeout_seconds": 1.0},
        "items": [{"id": "stuck", "label": "hang"}, {"id": "fine", "label": "x"}],
    }
    started = time.monotonic()
    response = hub.score(body)
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    stuck, fine = response.json()["results"]
    assert stuck["status"] == "SCORE_STATUS_TIMEOUT"
    assert stuck["error"] == "hang_on_label: exceeded its 1 s time limit"
    assert fine["status"] == "SCORE_STATUS_OK"
    assert elapsed < 2.5
    # The killed worker was replaced: a full pool scores again, over both transports.
    again = hub.score(arith_request([{"response": "1", "label": "1"}] * 4))
    assert [r["score"] for r in again.json()["results"]] == [1.0] * 4
    grpc_hang = stub.Score(
        reward_pb2.ScoreRequest(
            spec=reward_pb2.RewardSpec(terms=[reward_pb2.RewardTerm(function="hang")], timeout_seconds=0.5),
            items=[reward_pb2.ScoreItem(id="x")],
        ),
        timeout=10,
    )
    assert grpc_hang.results[0].status == reward_pb2.SCORE_STATUS_TIMEOUT
    deadline = time.monotonic() + 10
    while (workers := httpx.get(f"{hub.url}/health", timeout=10).json()["workers"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # live once it says READY: the replacement may be starting still
    assert workers == 2


@pytest.mark.parametrize(
    ("content", "status", "message"),
    [
        (b'{"items": [', 400, "request body is not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object (a ScoreRequest), got list"),
        (b'{"items": [{"id": "a", "answer": "1"}]}', 400, 'no field named "answer"'),
        (b'{"items": [{"id": 7}]}', 400, "Failed to parse id field"),
        (b'{"spec": {"terms": [{"function": "arith_exact", "weight": "heavy"}]}, "items": [{}]}', 400, "weight"),
        (b'{"spec": {"terms": [{"function": "nope"}]}, "items": [{}]}', 400, "unknown reward function 'nope'"),
        (b'{"spec": {"terms": [{"function": "arith_exact"}]}, "items": []}', 400, "items is empty"),
        (
            b'{"spec": {"terms": [{"function": "arith_exact"}]}, "items": [' + b"{}," * MAX_BATCH + b"{}]}",
            413,
            "items has 17 entries",
        ),
        (b'{"items": [{"prompt": "' + b"x" * MAX_BYTES + b'"}]}', 413, "request body is"),
        (b'{"items": [' + b"[" * 2000 + b"]" * 2000 + b"]}", 400, "request body nests arrays or objects too deeply"),
        (
            b'{"spec": {"terms": [{"function": "judge", "params": {"scale": NaN}}]}, "items": [{}]}',
            400,
            "spec.terms[0].params.scale: must be a finite number, got nan",
        ),
        (
            b'{"spec": {"terms": [{"function": "format", "params": {"x": [-Infinity]}}]}, "items": [{}]}',
            400,
            "spec.terms[0].params.x.0: must be a finite number, got -inf",
        ),
        (
            b'{"spec": {"terms": [{"function": "format", "params": {"x": ' + b"9" * 400 + b'}}]}, "items": [{}]}',
            400,
            "spec.terms[0].params.x: must be a finite number, got inf",
        ),
        (
            b'{"spec": {"terms": [{"function": "arith_exact", "weight": -' + b"1" * 5000 + b'}]}, "items": [{}]}',
            400,
            'value too small, use quoted "-Infinity" instead at ScoreRequest.spec.terms[0].weight',
        ),
    ],
)
def test_bad_http_input_is_a_4xx_naming_the_problem(hub: Hub, content: bytes, status: int, message: str) -> None:
    outcome = "invalid_input" if status == 400 else "resource_exhausted"
    before = refused(hub, outcome)
    response = httpx.post(f"{hub.url}/score", content=content, headers=JSON_BODY, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert error["code"] == status
    assert refused(hub, outcome) == before + 1  # counted, whether refused while reading or while checking


def refused(hub: Hub, outcome: str) -> float:
    text = httpx.get(f"{hub.url}/metrics", timeout=10).text
    line = f'rlfleet_reward_requests_total{{outcome="{outcome}"}} '
    return next((float(row.removeprefix(line)) for row in text.splitlines() if row.startswith(line)), 0.0)


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (reward_pb2.ScoreRequest(spec=reward_pb2.RewardSpec(terms=[reward_pb2.RewardTerm(function="arith_exact")])),
         grpc.StatusCode.INVALID_ARGUMENT, "items is empty"),
        (reward_pb2.ScoreRequest(
            spec=reward_pb2.RewardSpec(terms=[reward_pb2.RewardTerm(function="nope")]), items=[reward_pb2.ScoreItem()]),
         grpc.StatusCode.INVALID_ARGUMENT, "unknown reward function 'nope'; known: arith_exact"),
        (reward_pb2.ScoreRequest(
            spec=reward_pb2.RewardSpec(terms=[reward_pb2.RewardTerm(function="math")]),
            items=[reward_pb2.ScoreItem()] * (MAX_BATCH + 1)),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "the limit is 16"),
    ],
)  # fmt: skip
def test_bad_grpc_input_is_invalid_argument(
    stub: reward_pb2_grpc.RewardStub, request_: reward_pb2.ScoreRequest, code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        stub.Score(request_, timeout=10)
    assert raised.value.code() == code
    assert message in raised.value.details()


def test_items_that_share_an_id_are_refused_alike_over_both_transports(
    hub: Hub, stub: reward_pb2_grpc.RewardStub
) -> None:
    """Each result carries its item's id, and callers match results to items by it: two items of one id were both
    scored, and a caller read one item's result for both."""
    body = arith_request([{"id": "p1-s0", "response": "82", "label": "82"}, {"id": "p1-s0", "response": "81"}])
    message = (
        "items[1].id: 'p1-s0' is also the id of items[0]; results carry their item's id, so give each item its own "
        "(or leave ids empty and read the results in request order)"
    )
    before = refused(hub, "invalid_input")
    response = hub.score(body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"kind": "invalid_input", "message": message, "code": 400}
    with pytest.raises(grpc.RpcError) as raised:
        stub.Score(json_format.ParseDict(body, reward_pb2.ScoreRequest()), timeout=10)
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert refused(hub, "invalid_input") == before + 2


def test_a_pattern_nested_too_deeply_to_compile_is_the_callers_error(hub: Hub) -> None:
    """re.compile raises RecursionError, not re.error, for such a pattern: it was answered 500 and counted as the
    hub's own fault."""
    pattern = "(" * 1000 + "a" + ")" * 1000
    spec = {"terms": [{"function": "format", "params": {"pattern": pattern}}]}
    internal = refused(hub, "internal")
    response = httpx.post(f"{hub.url}/validate", json={"spec": spec}, timeout=10)
    assert response.status_code == 200, response.text
    [problem] = response.json()["problems"]
    assert problem["field"] == "terms[0].params.pattern" and "nested too deeply" in problem["message"], problem
    scored = hub.score({"spec": spec, "items": [{"response": "a"}]})
    assert scored.status_code == 400 and "nested too deeply" in scored.text, scored.text
    assert refused(hub, "internal") == internal


def test_over_grpc_max_request_bytes_limits_requests_not_responses(stub: reward_pb2_grpc.RewardStub) -> None:
    term = reward_pb2.RewardTerm(function="many_parts")
    term.params.update({"count": 1000})
    small = reward_pb2.ScoreRequest(
        spec=reward_pb2.RewardSpec(terms=[term]), items=[reward_pb2.ScoreItem()] * MAX_BATCH
    )
    response = stub.Score(small, timeout=10)
    assert response.ByteSize() > MAX_BYTES
    assert [len(r.components) for r in response.results] == [1001] * MAX_BATCH
    large = reward_pb2.ScoreRequest(spec=small.spec, items=[reward_pb2.ScoreItem(response="x" * MAX_BYTES)])
    with pytest.raises(grpc.RpcError) as raised:
        stub.Score(large, timeout=10)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "grpc-retry-pushback-ms" not in dict(raised.value.trailing_metadata() or ())  # retrying will not help


def test_a_grpc_score_request_that_does_not_decode_is_counted_as_invalid_input(hub: Hub) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{hub.grpc_port}") as channel:
        for method, counted in (("Score", 1), ("ValidateSpec", 0)):  # as over HTTP, /score's refusals only
            before = refused(hub, "invalid_input")
            call = channel.unary_unary(f"/rlfleet.v1.Reward/{method}")
            with pytest.raises(grpc.RpcError) as raised:
                call(b"\xff\xff\xff", timeout=10)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused(hub, "invalid_input") == before + counted


def test_non_finite_params_are_named_over_grpc_and_by_validate(hub: Hub, stub: reward_pb2_grpc.RewardStub) -> None:
    term = reward_pb2.RewardTerm(function="judge")
    term.params.update({"scale": float("inf")})
    spec = reward_pb2.RewardSpec(terms=[term])
    with pytest.raises(grpc.RpcError) as raised:
        stub.Score(reward_pb2.ScoreRequest(spec=spec, items=[reward_pb2.ScoreItem()]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "spec.terms[0].params.scale: must be a finite number, got inf"
    problems = stub.ValidateSpec(reward_pb2.ValidateSpecRequest(spec=spec), timeout=10).problems
    assert [(p.field, p.message) for p in problems] == [("terms[0].params.scale", "must be a finite number, got inf")]
    over_http = httpx.post(
        f"{hub.url}/validate",
        content=b'{"spec": {"terms": [{"function": "judge", "params": {"scale": Infinity}}]}}',
        headers=JSON_BODY,
        timeout=10,
    )
    assert over_http.status_code == 200, over_http.text
    assert over_http.json()["problems"] == [{"field": "terms[0].params.scale", "message": problems[0].message}]


def test_a_busy_hub_refuses_what_would_pass_its_pending_jobs_limit_after_its_wait_with_429_and_resource_exhausted(
    hub: Hub, stub: reward_pb2_grpc.RewardStub
) -> None:
    # Busy for longer than the two refusals' waits (0.3 s each) take.
    slow = {"spec": {"terms": [{"function": "sleep", "params": {"seconds": 2.0}}]}, "items": [{}] * 2}
    full = {"spec": {"terms": [{"function": "arith_exact"}, {"function": "exact"}]}, "items": [{}] * MAX_BATCH}
    before = refused(hub, "overloaded")
    with ThreadPoolExecutor(1) as executor:
        busy = executor.submit(hub.score, slow)
        deadline = time.monotonic() + 5
        while (busy_workers(hub) or 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        response = hub.score(full)
        with pytest.raises(grpc.RpcError) as over_grpc:
            stub.Score(json_format.ParseDict(full, reward_pb2.ScoreRequest()), timeout=10)
        assert busy.result(timeout=10).status_code == 200
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["kind"], error["code"]) == ("overloaded", 429)
    assert "this request adds 32, past its limit of 24 (max_pending_jobs); it waited 0.3 s for room" in error["message"]
    assert over_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "past its limit of 24 (max_pending_jobs)" in over_grpc.value.details()
    # What tells this refusal from a too-large request's over gRPC: the pushback, Retry-After in ms.
    assert dict(over_grpc.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"
    assert refused(hub, "overloaded") == before + 2
    # Idle again, the hub takes the same request, though it is more than the limit on its own.
    assert hub.score(full).status_code == 200


def test_every_functions_counters_exist_at_zero_before_its_first_item(hub: Hub) -> None:
    """A counter series that appears only at its first increment hides that increment from rate() and
    increase(): the first timeout of a function would never show on the dashboard."""
    text = httpx.get(f"{hub.url}/metrics", timeout=10).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    for status in ("ok", "error", "timeout"):
        assert f'rlfleet_reward_items_total{{function="code",status="{status}"}}' in samples
    assert 'rlfleet_reward_timeouts_total{function="remote"}' in samples
    assert 'rlfleet_reward_requests_total{outcome="invalid_input"}' in samples
    assert 'rlfleet_reward_requests_total{outcome="unavailable"}' in samples


def test_metrics_are_exported_after_scoring(hub: Hub) -> None:
    body = {"spec": {"terms": [{"function": "arith_exact"}, {"function": "raise"}]}, "items": [{"label": "1"}] * 3}
    assert hub.score(body).status_code == 200
    text = httpx.get(f"{hub.url}/metrics", timeout=10).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples['rlfleet_reward_items_total{function="arith_exact",status="ok"}']) >= 3
    assert float(samples['rlfleet_reward_items_total{function="raise",status="error"}']) == 3
    assert float(samples['rlfleet_reward_item_seconds_count{function="raise"}']) == 3
    assert float(samples['rlfleet_reward_requests_total{outcome="ok"}']) >= 1
    assert float(samples["rlfleet_reward_pool_workers"]) == 2
    assert "rlfleet_reward_pool_busy_workers" in samples
    assert "rlfleet_reward_admission_pending_jobs" in samples
    assert "rlfleet_reward_admission_waiting_requests" in samples


def busy_workers(hub: Hub) -> int | None:
    """From /health; None while it answers 503: every worker was replaced and none has said READY yet."""
    response = httpx.get(f"{hub.url}/health", timeout=10)
    return response.json()["busy_workers"] if response.status_code == 200 else None


def test_a_client_that_leaves_frees_the_workers_over_http_as_over_grpc(hub: Hub) -> None:
    # Eight items of 1 s on two workers: 4 s of work nobody will read once the client gives up.
    body = {"spec": {"terms": [{"function": "sleep", "params": {"seconds": 1.0}}]}, "items": [{}] * 8}
    with pytest.raises(httpx.ReadTimeout):
        hub.score(body, timeout=0.5)
    deadline = time.monotonic() + 2.5
    while busy_workers(hub) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert busy_workers(hub) == 0
    assert time.monotonic() < deadline
    again = hub.score(arith_request([{"response": "1", "label": "1"}] * 4))
    assert [r["score"] for r in again.json()["results"]] == [1.0] * 4
    text = httpx.get(f"{hub.url}/metrics", timeout=10).text
    assert 'rlfleet_reward_requests_total{outcome="cancelled"} 1.0' in text


def test_a_client_that_leaves_while_sending_its_body_is_counted_as_cancelled(hub: Hub) -> None:
    internal, cancelled = refused(hub, "internal"), refused(hub, "cancelled")
    for route in ("/validate", "/score"):
        head = f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += "Content-Length: 1000\r\n\r\n"
        with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as client:
            client.sendall(head.encode() + b'{"items": [')
    deadline = time.monotonic() + 5
    while refused(hub, "cancelled") == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (refused(hub, "internal"), refused(hub, "cancelled")) == (internal, cancelled + 1)
    assert "ClientDisconnect" not in hub.process.log_path.read_text(), "a client that left is no fault of the hub's"


def test_with_port_0_the_log_names_the_ports_bound(tmp_path: Path) -> None:
    argv = [sys.executable, str(LAUNCHER), "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--workers", "1"]
    process = ServiceProcess("reward-hub-port-0", argv, tmp_path / "hub.log", env={"RLFLEET_LOG_FORMAT": "text"})
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"serving HTTP on 127\.0\.0\.1:(\d+), gRPC on port (\d+)", process.log_tail())):
            assert process.alive() and time.monotonic() < deadline, process.log_tail()
            time.sleep(0.1)
        http_port, grpc_port = int(found[1]), int(found[2])
        assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=10).status_code == 200
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            functions = reward_pb2_grpc.RewardStub(channel).ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=10)
        assert "exact" in [f.name for f in functions.functions]
    finally:
        process.stop(timeout=10)


@pytest.mark.parametrize("stopped_by", ["sigterm", "service_process_stop"])
def test_sigterm_lets_requests_finish_then_stops_the_hub_and_its_workers(tmp_path: Path, stopped_by: str) -> None:
    """Kubernetes and `docker stop` signal the hub alone, and so do `rlfleet up` and `rlfleet down`
    (ServiceProcess.stop): a signal to its whole process group ended its fork server and so, as the hub saw
    it, every worker, mid-item."""
    hub = Hub(tmp_path, "reward-hub-shutdown")
    try:
        descendants = _descendants(hub.process.pid)
        assert len(descendants) >= 3  # the fork server and two workers
        slow = {"spec": {"terms": [{"function": "sleep", "params": {"seconds": 0.8}}]}, "items": [{}]}
        with ThreadPoolExecutor(1) as executor:
            in_flight = executor.submit(hub.score, slow)
            time.sleep(0.3)
            started = time.monotonic()
            if stopped_by == "sigterm":  # the hub must stop its workers itself
                os.kill(hub.process.pid, signal.SIGTERM)
            else:
                hub.process.stop(timeout=10)
            result = in_flight.result(timeout=10).json()["results"][0]
            assert result["status"] == "SCORE_STATUS_OK", result
        assert hub.process.proc.wait(timeout=10) == 0, hub.process.log_tail()
        assert time.monotonic() - started < 5
        assert "reward hub stopped" in hub.process.log_tail()
        assert "died" not in hub.process.log_tail()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in descendants) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in descendants if _alive(pid)]
    finally:
        hub.process.stop(timeout=5)


def test_requests_still_scoring_when_the_grace_is_over_are_answered_unavailable(tmp_path: Path) -> None:
    """Before, uvicorn cut the HTTP request off with a 500 (and a traceback in the log), gRPC's server with
    "Cancelling all calls": neither said the hub had stopped, nor that the request may be sent again."""
    hub = Hub(tmp_path, "reward-hub-grace")  # a grace of 2 s
    try:
        sleep = {"function": "sleep", "params": {"seconds": 30}}
        slow = {"spec": {"terms": [sleep], "timeout_seconds": 60}, "items": [{}]}
        with ThreadPoolExecutor(2) as executor, grpc.insecure_channel(f"127.0.0.1:{hub.grpc_port}") as channel:
            over_http = executor.submit(hub.score, slow, 30)
            stub = reward_pb2_grpc.RewardStub(channel)
            over_grpc = executor.submit(stub.Score, json_format.ParseDict(slow, reward_pb2.ScoreRequest()), 30)
            deadline = time.monotonic() + 10
            while (busy_workers(hub) or 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            started = time.monotonic()
            os.kill(hub.process.pid, signal.SIGTERM)
            response = over_http.result(timeout=20)
            with pytest.raises(grpc.RpcError) as refused:
                over_grpc.result(timeout=20)
        assert time.monotonic() - started < 5
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["kind"] == "unavailable" and "shutting down" in error["message"], error
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in str(refused.value.details())
        assert hub.process.proc.wait(timeout=15) == 0, hub.process.log_tail()
        log = hub.process.log_path.read_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    finally:
        hub.process.stop(timeout=5)


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has yet to collect the status.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
