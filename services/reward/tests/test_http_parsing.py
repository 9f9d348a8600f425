"""The REST face's request parsing: a large body is parsed off the event loop, a small one on it; a field of the
wrong type is refused naming it; a body not declared JSON is refused."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from rlfleet.errors import InvalidInput
from rlfleet.v1 import reward_pb2
from rlfleet_reward import http_app
from rlfleet_reward.metrics import RewardMetrics


class EchoScorer:
    """Answers one OK result per item, without scoring."""

    async def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(id=item.id) for item in request.items])

    def validate_spec(self, request: reward_pb2.ValidateSpecRequest) -> reward_pb2.ValidateSpecResponse:
        return reward_pb2.ValidateSpecResponse()


def body(items: int, response_chars: int) -> bytes:
    spec = {"terms": [{"function": "exact"}]}
    return json.dumps(
        {"spec": spec, "items": [{"id": str(i), "response": "x" * response_chars} for i in range(items)]}
    ).encode()


@pytest.mark.parametrize(("size", "off_loop"), [(1_000, False), (3 << 20, True)])
def test_a_body_past_a_mebibyte_is_parsed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, size: int, off_loop: bool
) -> None:
    """60 MB of items took 6 s to parse on the event loop, and every other request (/health too) waited."""
    threads: list[threading.Thread] = []
    parse = http_app.parse_request

    def recording(raw: bytes, message: http_app.M) -> http_app.M:
        threads.append(threading.current_thread())
        return parse(raw, message)

    monkeypatch.setattr(http_app, "parse_request", recording)
    app = http_app.create_app(EchoScorer(), RewardMetrics(), max_request_bytes=64 << 20)  # type: ignore[arg-type]
    content = body(items=64, response_chars=size // 64)

    async def post() -> tuple[httpx.Response, threading.Thread]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hub") as client:
            response = await client.post("/score", content=content, headers={"content-type": "application/json"})
        return response, threading.current_thread()

    response, loop_thread = asyncio.run(post())
    assert response.status_code == 200, response.text
    assert len(response.json()["results"]) == 64
    assert len(threads) == 1 and (threads[0] is not loop_thread) == off_loop


def test_true_or_false_for_a_weight_is_refused_naming_it() -> None:
    """protobuf reads true for a double as 1.0: a term's weight of true was a weight of 1."""
    spec = {"terms": [{"function": "exact", "weight": True}]}
    sent = json.dumps({"spec": spec, "items": [{"id": "0", "response": "x"}]}).encode()
    with pytest.raises(InvalidInput, match=r"spec\.terms\[0\]\.weight: expected a number, got true or false"):
        http_app.parse_request(sent, reward_pb2.ScoreRequest())


@pytest.mark.parametrize(
    ("content_type", "sent"),
    [
        (None, "the request has no Content-Type"),
        ("text/plain;charset=UTF-8", "the request's Content-Type is 'text/plain;charset=UTF-8'"),
        ("application/x-www-form-urlencoded", "the request's Content-Type is 'application/x-www-form-urlencoded'"),
        ("multipart/form-data; boundary=x", "the request's Content-Type is 'multipart/form-data; boundary=x'"),
    ],
)
def test_a_body_not_declared_json_is_refused_by_score_and_validate(content_type: str | None, sent: str) -> None:
    """Each was read as JSON and scored: a web page can POST any of these across sites without the browser asking
    the hub first, so any site visited by a user of a hub on localhost could run programs in its `code` sandbox."""
    metrics = RewardMetrics()
    app = http_app.create_app(EchoScorer(), metrics, max_request_bytes=1 << 20)  # type: ignore[arg-type]
    headers = {} if content_type is None else {"content-type": content_type}

    async def post(path: str, content: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hub") as client:
            return await client.post(path, content=content, headers=headers)

    expected = f"body: not read as JSON: {sent}; send it with Content-Type: application/json"
    for path, content in (("/score", body(items=1, response_chars=1)), ("/validate", b'{"spec": {}}')):
        response = asyncio.run(post(path, content))
        assert response.status_code == 400, (path, response.text)
        assert response.json() == {"error": {"kind": "invalid_input", "message": expected, "code": 400}}
    # Counted as every other refusal of /score; /validate's are not counted.
    assert metrics.registry.get_sample_value("rlfleet_reward_requests_total", {"outcome": "invalid_input"}) == 1.0


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8", "application/x+json"])
def test_a_body_declared_json_is_read(content_type: str) -> None:
    app = http_app.create_app(EchoScorer(), RewardMetrics(), max_request_bytes=1 << 20)  # type: ignore[arg-type]

    async def post(path: str, content: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hub") as client:
            return await client.post(path, content=content, headers={"content-type": content_type})

    scored = asyncio.run(post("/score", body(items=2, response_chars=1)))
    assert scored.status_code == 200 and [r["id"] for r in scored.json()["results"]] == ["0", "1"], scored.text
    validated = asyncio.run(post("/validate", b'{"spec": {}}'))
    assert validated.status_code == 200 and validated.json() == {"problems": []}, validated.text
