"""Headers through the router: an answer's are the engine's own, once each, plus the engine's URL; a request's
Content-Type says JSON, which its body is, and a request header given on several lines keeps every value."""

from __future__ import annotations

from collections.abc import Callable

import httpx
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


def test_a_json_body_reaches_the_engine_as_json_whatever_the_client_called_it(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    body = '{"text": "hi"}'
    # curl -d sends form data's type, some clients none; a JSON type of the client's own is left as it is.
    for sent in ("application/x-www-form-urlencoded", None, "application/json; charset=utf-8"):
        headers = {"content-type": sent} if sent else {}
        response = router.client.post("/generate", content=body, headers=headers)
        assert response.status_code == 200, response.text
    assert engine.content_types == ["application/json", "application/json", "application/json; charset=utf-8"]
    assert engine.raw_bodies == [body.encode()] * 3


def test_a_request_header_on_several_lines_reaches_the_engine_with_every_value(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    tags = httpx.Headers([("x-tag", "one"), ("x-tag", "two")])
    # The parser's path, and uvicorn's (a client that waits for 100 Continue takes it).
    for extra in ({}, {"expect": "100-continue"}):
        headers = httpx.Headers(tags)
        headers.update(extra)
        response = router.client.post("/generate", json={"text": "hi"}, headers=headers)
        assert response.status_code == 200, response.text
    assert engine.tags == [["one, two"], ["one, two"]]  # joined in order, as HTTP allows
