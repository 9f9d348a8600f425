"""The trainer's router client: what a weight load asks of the fleet."""

from __future__ import annotations

from typing import Any

from rlfleet_trainer.router_client import RouterClient


def test_a_load_asks_to_abort_generations_only_when_told(fake_router: Any) -> None:
    client = RouterClient(fake_router.url, 10.0)
    client.load_weights("/weights/v1", 1)
    client.load_weights("/weights/v2", 2, abort_all_requests=True)
    assert fake_router.loads == [
        {"model_path": "/weights/v1", "weight_version": "1"},
        {"model_path": "/weights/v2", "weight_version": "2", "abort_all_requests": True},
    ]
