"""The REST face's request parsing: a large body is parsed off the event loop, a small one on it; a field of the
wrong type is refused naming it."""

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
