"""The trainer's router client: what a weight load asks of the fleet."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.errors import Conflict
from rlfleet_trainer.router_client import RouterClient


def test_a_load_asks_to_abort_generations_only_when_told(fake_router: Any) -> None:
    client = RouterClient(fake_router.url, 10.0)
    client.load_weights("/weights/v1", 1)
    client.load_weights("/weights/v2", 2, abort_all_requests=True)
    assert fake_router.loads == [
        {"model_path": "/weights/v1", "weight_version": "1"},
        {"model_path": "/weights/v2", "weight_version": "2", "abort_all_requests": True},
    ]


@pytest.mark.parametrize("status", [404, 200])
def test_an_answer_that_is_not_json_names_the_url_and_the_status(fake_router: Any, status: int) -> None:
    """A proxy's page or a wrong URL's 404 is not the router: said at once, not as a JSON decoding error."""
    fake_router.page_status = status
    with pytest.raises(Conflict) as refused:
        RouterClient(fake_router.url, 10.0).load_weights("/weights/v1", 1)
    message = str(refused.value)
    assert f"POST {fake_router.url}/update_weights_from_disk answered HTTP {status}" in message
    assert "router_url" in message and "nginx" in message
