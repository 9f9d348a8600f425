"""The trainer's router client: what a weight load asks of the fleet."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rlfleet.errors import Conflict, Unavailable
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


def test_a_load_one_engine_failed_is_not_sent_again(fake_router: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The router's 502 once an engine failed a load the others took: the fleet serves the version, the engine that
    failed is out of routing until it loads it. Sent again, every other engine would load the same version twice."""
    fake_router.partial_loads = ["3"]
    with caplog.at_level(logging.WARNING, logger="rlfleet_trainer.router_client"):
        RouterClient(fake_router.url, 10.0).load_weights("/weights/v3", 3)
    assert fake_router.calls == ["/update_weights_from_disk"]
    assert fake_router.loads == [{"model_path": "/weights/v3", "weight_version": "3"}]
    assert "taken out of routing: http://127.0.0.1:30002" in caplog.text  # conftest's FAILED_ENGINE


def test_a_load_no_engine_took_is_sent_again(fake_router: Any) -> None:
    """The router's 502 when no engine loaded it names the version the fleet still serves: retried."""
    fake_router.partial_loads = ["2", "2"]
    RouterClient(fake_router.url, 10.0).load_weights("/weights/v3", 3)
    assert fake_router.calls == ["/update_weights_from_disk"] * 3
    fake_router.partial_loads = ["2"] * 100
    with pytest.raises(Unavailable, match="did not load weight version 3 .*HTTP 502"):
        RouterClient(fake_router.url, 1.0).load_weights("/weights/v3", 3)
