"""Every node of a multi-node trainer answers /health, as Kubernetes probes every trainer pod.

Two torchrun launchers on this machine play two nodes of one job (`--nnodes 2 --node-rank K`, static
rendezvous on node 0), each with its own HTTP port as two pods would have. Node 0 runs rank 0, which
serves the Trainer API (gRPC) beside /health; node 1's first rank only follows, yet answers /health,
saying which rank it is and that it does not serve the API, and /metrics with its rank ops.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet_trainer.node_http import serving_in_thread

START_TIMEOUT_S = 90.0
REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def node(rank: int, master_port: int, ports: tuple[int, int], redis_prefix: str, tmp_path: Path) -> ServiceProcess:
    http_port, grpc_port = ports
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node-rank={rank}",
        "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={master_port}",
        "-m", "rlfleet_trainer", "serve", "--host", "127.0.0.1", "--http-port", str(http_port),
        "--grpc-port", str(grpc_port), "--router-url", "http://127.0.0.1:9", "--work-dir", str(tmp_path / "work"),
        "--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, "--collective-timeout-s", "60",
    ]  # fmt: skip
    return ServiceProcess(f"trainer-node-{rank}", argv, tmp_path / f"node{rank}.log", env={"OMP_NUM_THREADS": "1"})


@pytest.mark.e2e
def test_every_node_answers_health_and_only_rank_0_serves_the_api(tmp_path: Path, redis_prefix: str) -> None:
    master_port, grpc_port = free_port(), free_port()
    http_ports = [free_port(), free_port()]
    nodes = [node(rank, master_port, (http_ports[rank], grpc_port), redis_prefix, tmp_path) for rank in (0, 1)]
    try:
        for rank, process in enumerate(nodes):
            process.wait_healthy(f"http://127.0.0.1:{http_ports[rank]}/health", START_TIMEOUT_S)
        leader, follower = (httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json() for port in http_ports)
        assert leader == {"status": "ok", "rank": 0, "world_size": 2, "serves_api": True}
        assert follower == {"status": "ok", "rank": 1, "world_size": 2, "serves_api": False}

        metrics = httpx.get(f"http://127.0.0.1:{http_ports[1]}/metrics", timeout=5).text
        assert "rlfleet_trainer_ranks 2.0" in metrics and "rlfleet_trainer_rank_op_seconds" in metrics
        # A follower trains no run of its own: no step or loss of its own to report.
        assert "rlfleet_trainer_step " not in metrics and "rlfleet_trainer_loss " not in metrics

        # The Trainer API answers on rank 0 (an unknown run is its answer, not a transport error).
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, pytest.raises(grpc.RpcError) as refused:
            trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.StatusRequest(run_id="none"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value

        # Stopping rank 0's node releases the follower: its node ends cleanly, HTTP thread and all.
        nodes[0].stop(timeout=30)
        try:
            code = nodes[1].proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"node 1 exited with {code}; last lines of its log:\n{nodes[1].log_tail(40)}"
    finally:
        for process in nodes:
            process.stop(timeout=10)


def test_a_node_whose_http_port_is_taken_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port} .*--http-port"):
            with serving_in_thread(FastAPI(), "127.0.0.1", port, start_timeout_s=10):
                pass
