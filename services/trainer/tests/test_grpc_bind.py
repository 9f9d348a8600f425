"""`--host` with an IPv6 address: the gRPC server bound f"{host}:{port}" (`::1:50052`), which gRPC refuses
("Misformatted domain name"), so `serve --host ::` could not start; the address needs brackets (`[::1]:50052`)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from rlfleet.host_port import host_port
from rlfleet.processes import free_port
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import StatusRequest, TrainerState, TrainerStatus
from rlfleet_trainer.grpc_server import make_grpc_server
from rlfleet_trainer.trainer_core import TrainerCore


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    ("host", "address"),
    [("::1", "[::1]:7"), ("::", "[::]:7"), ("[::1]", "[::1]:7"), ("127.0.0.1", "127.0.0.1:7"), ("node-0", "node-0:7")],
)
def test_host_port_brackets_an_ipv6_address(host: str, address: str) -> None:
    assert host_port(host, 7) == address


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "::"])
def test_the_grpc_server_binds_an_ipv6_host_and_answers_there(core: TrainerCore, host: str) -> None:
    port = free_port()

    async def serve_and_ask() -> TrainerStatus:
        server = make_grpc_server(core, host, port)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
                return await trainer_pb2_grpc.TrainerStub(channel).Status(StatusRequest(), timeout=10)
        finally:
            await server.stop(grace=None)

    assert asyncio.run(serve_and_ask()).state == TrainerState.TRAINER_STATE_IDLE
