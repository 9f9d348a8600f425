"""The reward hub's client: a group's items are scored in requests the hub takes, their results in order."""

from __future__ import annotations

import asyncio
import json

import httpx

from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult
from rlfleet_rollout import reward_client
from rlfleet_rollout.reward_client import RewardClient

HUB_LIMIT = 10 * 1024 * 1024  # a hub's --max-request-bytes


def test_a_group_too_large_for_one_request_is_scored_in_several_in_order() -> None:
    """A group repeats its label in every item: 8 x 3 MB passed the hub's body limit, and its 413 failed the run."""
    bodies: list[int] = []

    def hub(request: httpx.Request) -> httpx.Response:
        bodies.append(len(request.content))
        if len(request.content) > HUB_LIMIT:
            return httpx.Response(413, json={"error": {"message": "request body too large"}})
        items = json.loads(request.content)["items"]
        return httpx.Response(200, json={"results": [{"id": item["id"], "score": float(item["id"])} for item in items]})

    async def scenario() -> list[ScoreResult]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(hub)) as client:
            rewards = RewardClient(client, "http://hub", score_timeout_s=5, validate_timeout_s=5)
            items = [ScoreItem(id=str(i), response="42", label="x" * 3_000_000) for i in range(8)]
            return await rewards.score(RewardSpec(), items)

    results = asyncio.run(scenario())
    assert [r.score for r in results] == [float(i) for i in range(8)]
    assert len(bodies) > 1 and max(bodies) <= reward_client.SCORE_REQUEST_BYTES + 3_100_000


def test_a_small_group_is_one_request() -> None:
    calls: list[int] = []

    def hub(request: httpx.Request) -> httpx.Response:
        items = json.loads(request.content)["items"]
        calls.append(len(items))
        return httpx.Response(200, json={"results": [{"id": item["id"]} for item in items]})

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(hub)) as client:
            rewards = RewardClient(client, "http://hub", score_timeout_s=5, validate_timeout_s=5)
            await rewards.score(RewardSpec(), [ScoreItem(id=str(i), response="1") for i in range(16)])

    asyncio.run(scenario())
    assert calls == [16]
