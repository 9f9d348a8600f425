"""The API token: required on the Runs API (REST and gRPC) and on the router's admin endpoints,
checked in constant time, refused with a clear 401 / UNAUTHENTICATED, and never needed by probes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.testclient import TestClient
from launchers import Service, stored_runs
from prometheus_client import CollectorRegistry

from rlfleet.api_token import ApiTokenGuard, client_token, read_token_file
from rlfleet.errors import InvalidInput, Unauthenticated
from rlfleet.http_auth import WS_POLICY_VIOLATION, require_api_token
from rlfleet.v1 import runs_pb2, runs_pb2_grpc

pytestmark = pytest.mark.e2e


def guard(token: str | None = "s3cret") -> ApiTokenGuard:
    return ApiTokenGuard(token, CollectorRegistry(), "test")


def test_the_guard_accepts_only_the_bearer_token_and_counts_refusals() -> None:
    g = guard()
    g.check("Bearer s3cret", "http")
    g.check("bearer   s3cret ", "grpc")  # the scheme is case-insensitive (RFC 9110)
    refusals = {
        None: "needs the API token",
        "": "needs the API token",
        "s3cret": "must read 'Bearer <token>'",
        "Basic s3cret": "must read 'Bearer <token>'",
        "Bearer ": "must read 'Bearer <token>'",
        "Bearer s3cre": "wrong API token",
        "Bearer s3cret2": "wrong API token",
    }
    for header, message in refusals.items():
        with pytest.raises(Unauthenticated, match=message):
            g.check(header, "http")
    assert g.rejected.labels(transport="http")._value.get() == len(refusals)
    guard(None).check(None, "http")  # no token configured: open


def test_a_websocket_needs_the_token_as_any_other_route() -> None:
    """The middleware let every scope but http through: a websocket route would have been open to anyone."""
    app = FastAPI()

    @app.websocket("/ws")
    async def echo(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("in")
        await socket.close()

    require_api_token(app, guard())
    client = TestClient(app)
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws"):
        pass
    assert refused.value.code == WS_POLICY_VIOLATION and "needs the API token" in refused.value.reason
    with client.websocket_connect("/ws", headers={"Authorization": "Bearer s3cret"}) as socket:
        assert socket.receive_text() == "in"


def test_token_files_are_read_once_and_bad_ones_named(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  abc\n")
    assert read_token_file(path) == "abc"
    assert read_token_file(None) is None and read_token_file("") is None
    path.write_text("\n")
    with pytest.raises(InvalidInput, match="is empty"):
        read_token_file(path)
    with pytest.raises(InvalidInput, match="cannot read the API token"):
        read_token_file(tmp_path / "missing")
    path.write_text("from-file")
    env = {"RLFLEET_API_TOKEN_FILE": str(path), "RLFLEET_API_TOKEN": "from-env"}
    assert client_token(env) == "from-file"
    assert client_token({"RLFLEET_API_TOKEN": "from-env"}) == "from-env"
    assert client_token({}) is None


@pytest.mark.parametrize(
    ("mode", "warning"),
    [
        (0o400, None),
        (0o440, None),  # Kubernetes mounts the Secret so, for the pod's fsGroup
        (0o644, "mode 0o644: any user can read it"),
        (0o666, "mode 0o666: any user can read it, any user can change it, its group can change it"),
        (0o460, "mode 0o460: its group can change it"),
    ],
)
def test_a_token_file_others_may_read_or_change_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warning: str | None
) -> None:
    """A token file at 0666 was used without a word: every user of the machine could read the token or set it."""
    path = tmp_path / "token"
    path.write_text("abc")
    path.chmod(mode)
    with caplog.at_level("WARNING", logger="rlfleet.api_token"):
        assert read_token_file(path) == "abc"
    messages = [record.getMessage() for record in caplog.records]
    if warning is None:
        assert messages == []
    else:
        [message] = messages
        assert f"api_token_file: {path} has {warning}; chmod it 0400" in message


def test_runs_api_rest_needs_the_token_and_probes_do_not(
    orchestrator: Service, api_token: tuple[str, Path], redis_client: redis.Redis, runs_prefix: str
) -> None:
    token, _ = api_token
    before = stored_runs(redis_client, runs_prefix)
    with httpx.Client(base_url=orchestrator.url, timeout=10) as http:
        for method, path in (
            ("GET", "/v1/runs"),
            ("GET", "/v1/runs/x"),
            ("POST", "/v1/runs"),
            ("POST", "/v1/runs/x:cancel"),
            ("GET", "/v1/runs/x:watch"),
            ("GET", "/docs"),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                answer = http.request(method, path, headers=headers, json={"schedule": {"steps": 1}})
                assert answer.status_code == 401, (method, path, headers, answer.text)
                assert answer.headers["www-authenticate"].startswith("Bearer")
                error = answer.json()["error"]
                assert error["kind"] == "unauthenticated" and "rollout:" in error["message"]
        assert http.get("/health").status_code == 200
        scrape = http.get("/metrics")
        assert scrape.status_code == 200
        assert 'rlfleet_rollout_unauthenticated_requests_total{transport="http"} 18.0' in scrape.text
        authorized = http.get("/v1/runs", headers={"Authorization": f"Bearer {token}"})
        assert authorized.status_code == 200, authorized.text
    assert stored_runs(redis_client, runs_prefix) == before, "a refused submit stored a run"


def test_runs_api_grpc_needs_the_token_in_metadata(orchestrator: Service, api_token: tuple[str, Path]) -> None:
    token, _ = api_token
    with grpc.insecure_channel(orchestrator.grpc_address) as channel:
        runs = runs_pb2_grpc.RunsStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", token),)):
            with pytest.raises(grpc.RpcError) as refused:
                runs.List(runs_pb2.ListRunsRequest(), metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API token" in refused.value.details() or "Bearer" in refused.value.details()
            with pytest.raises(grpc.RpcError) as watch_refused:
                list(runs.Watch(runs_pb2.WatchRunRequest(id="x"), metadata=metadata, timeout=10))
            assert watch_refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = runs.List(runs_pb2.ListRunsRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        assert isinstance(answer, runs_pb2.ListRunsResponse)
        with pytest.raises(grpc.RpcError) as missing:
            runs.Get(runs_pb2.GetRunRequest(id="nope"), metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # past the guard, the handler answered


def test_the_cli_sends_the_token_from_its_file(orchestrator: Service, api_token: tuple[str, Path]) -> None:
    _, path = api_token
    base = [sys.executable, "-m", "rlfleet.cli", "runs", "--api", orchestrator.url]

    def cli(extra: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        clean = {"PATH": "/usr/bin:/bin", **env}  # no RLFLEET_API_TOKEN* from the calling shell
        return subprocess.run(base + extra, capture_output=True, text=True, timeout=60, env=clean)

    refused = cli([], {})
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr, refused.stderr
    for extra, env in (([], {"RLFLEET_API_TOKEN_FILE": str(path)}), (["--api-token-file", str(path)], {})):
        listed = cli(extra, env)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.startswith("ID")


def test_router_admin_endpoints_need_the_token_and_generation_does_not(
    secured_router: Service, api_token: tuple[str, Path]
) -> None:
    token, _ = api_token
    bearer = {"Authorization": f"Bearer {token}"}
    admin = [
        ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
        ("DELETE", "/workers/http://127.0.0.1:9", None),
        ("POST", "/update_weights_from_disk", {"model_path": "sim", "weight_version": "1"}),
        ("POST", "/abort_request", {"rid": "x"}),
        ("POST", "/pause_generation", {}),
        ("POST", "/continue_generation", {}),
        ("POST", "/flush_cache", {}),
        ("GET", "/flush_cache", None),  # SGLang serves it on GET too: a GET that changes state
        ("DELETE", "/trajectories/x", None),
    ]
    with httpx.Client(base_url=secured_router.url, timeout=30) as http:
        for method, path, body in admin:
            for headers in ({}, {"Authorization": "Bearer nope"}):
                answer = http.request(method, path, json=body, headers=headers)
                assert answer.status_code == 401, (method, path, answer.text)
                assert answer.json()["error"]["kind"] == "unauthenticated"
        for path in ("/health", "/liveness", "/metrics", "/workers", "/fleet", "/weight_version"):
            assert http.get(path).status_code == 200, path
        generated = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert generated.status_code == 200, generated.text
        # With the token the same requests reach the router (and the engine behind it).
        assert http.post("/flush_cache", json={}, headers=bearer).status_code == 200
        assert http.get("/flush_cache", headers=bearer).status_code == 200
        weights = http.post(
            "/update_weights_from_disk", json={"model_path": "sim", "weight_version": "1"}, headers=bearer
        )
        assert weights.status_code == 200, weights.text
        added = http.post("/workers", json={"url": "http://127.0.0.1:9"}, headers=bearer)
        assert added.status_code == 202, added.text
        assert http.delete("/workers/http://127.0.0.1:9", headers=bearer).status_code == 200
        assert 'rlfleet_router_unauthenticated_requests_total{transport="http"} 18.0' in http.get("/metrics").text
