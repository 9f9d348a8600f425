"""The hub's start: a worker pool that cannot start ends it with one line, its ports freed."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.processes import free_port, port_is_free
from rlfleet_reward.__main__ import serve, settings_from_args
from rlfleet_reward.registry import Registry
from rlfleet_reward.worker_pool import WorkerPool


def test_a_worker_pool_that_cannot_start_ends_the_hub_saying_so_with_its_ports_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def cannot_start(self: WorkerPool) -> None:
        raise RuntimeError("a reward worker failed to start (exit code 1); see the log")

    monkeypatch.setattr(WorkerPool, "start", cannot_start)
    http_port, grpc_port = free_port(), free_port()
    settings = settings_from_args(["--port", str(http_port), "--grpc-port", str(grpc_port)])
    with pytest.raises(SystemExit, match=r"reward hub cannot start its worker pool: a reward worker failed to start"):
        asyncio.run(serve(settings, Registry.from_entry_points()))
    assert port_is_free(http_port) and port_is_free(grpc_port)
