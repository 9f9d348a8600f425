"""The reward hub's client: a group's items are scored in requests the hub takes, their results in order; a spec's
problems are the hub's judgement of it, and a hub that answers /validate with an error status is misconfigured."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlfleet.errors import Conflict, InvalidInput
from rlfleet.v1.reward_pb2 import RewardSpec, RewardTerm, ScoreItem, ScoreResult, SpecProblem
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


def _spec_problems(answer: httpx.Response) -> list[SpecProblem]:
    """spec_problems of a one-term spec, against a hub answering /validate with `answer`."""

    async def scenario() -> list[SpecProblem]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answer)) as client:
            rewards = RewardClient(client, "http://hub:8001", score_timeout_s=5, validate_timeout_s=5)
            return await rewards.spec_problems(RewardSpec(terms=[RewardTerm(function="arith_exact")]))

    return asyncio.run(scenario())


def test_the_hubs_refusal_of_a_spec_is_its_problems_by_field() -> None:
    problems = {"problems": [{"field": "terms[0].function", "message": "unknown reward function 'arith_exac'"}]}
    assert [(p.field, p.message) for p in _spec_problems(httpx.Response(200, json=problems))] == [
        ("terms[0].function", "unknown reward function 'arith_exac'")
    ]


@pytest.mark.parametrize(
    "status, body",
    [
        (404, {"detail": "Not Found"}),  # an older hub without /validate, or another service at the URL
        (401, {"error": "missing bearer token"}),  # an auth proxy in front of the hub
        (403, {"error": "forbidden"}),
        (400, {"error": {"kind": "invalid_input", "message": "invalid ValidateSpecRequest: unknown field"}}),
    ],
)
def test_a_hub_answering_validate_with_a_4xx_is_misconfigured_not_the_specs_fault(status: int, body: dict) -> None:
    """The hub refuses a spec with its problems in a 200: a 4xx reached Submit as INVALID_ARGUMENT, blaming a spec
    that no edit could mend."""
    with pytest.raises(Conflict) as refused:
        _spec_problems(httpx.Response(status, json=body))
    assert not isinstance(refused.value, InvalidInput)
    assert str(refused.value).startswith(
        f"the reward hub at http://hub:8001 answered POST /validate with HTTP {status}"
    )
