"""`--host` with an IPv6 address: the Runs API's gRPC server bound f"{host}:{port}", which gRPC refuses for `::1`
or `::` (the address needs brackets), so the orchestrator could not start on an IPv6 host."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from rlfleet.api_token import ApiTokenGuard
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.runs_core import RunsCore


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "::"])
def test_the_runs_grpc_server_binds_an_ipv6_host(host: str) -> None:
    async def bind() -> int:
        guard = ApiTokenGuard(None, CollectorRegistry(), "rollout")
        server, port = build_grpc_server(cast(RunsCore, cast(Any, None)), host, 0, guard, keepalive_s=30)
        await server.stop(grace=None)
        return port

    assert asyncio.run(bind()) > 0
