"""The headers of an answer relayed through the router: the engine's own, once each, plus the engine's URL."""

from __future__ import annotations

from collections.abc import Callable

from router_fakes import FakeEngine, RunningRouter


def test_a_relayed_answer_has_one_date_and_one_server_field(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    for body in ({"text": "hi"}, {"text": "hi", "stream": True, "chunks": 2}):
        response = router.client.post("/generate", json=body)
        assert response.status_code == 200
        # Both the engine's server and the router's set Date and Server; HTTP allows one of each.
        assert len(response.headers.get_list("date")) == 1
        assert len(response.headers.get_list("server")) == 1
        assert response.headers["x-rlfleet-engine"] == engine.url
