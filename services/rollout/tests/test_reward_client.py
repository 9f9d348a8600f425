"""The reward hub's client: a group's items are scored in requests the hub takes, their results in order; a spec's
problems are the hub's judgement of it, and a hub that answers /validate or /score with a 4xx is misconfigured (or
behind a proxy that refuses the orchestrator): a run fails at once naming the hub, not the spec."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlfleet.errors import Conflict, InvalidInput
from rlfleet.v1.reward_pb2 import RewardSpec, RewardTerm, ScoreItem, ScoreResult, ScoreStatus, SpecProblem
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet_rollout import reward_client
from rlfleet_rollout.group_producer import RolloutContext
from rlfleet_rollout.metrics import RolloutMetrics
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


def _scored_in_a_run(answer: httpx.Response) -> list[ScoreResult]:
    """What a run's rollout gets scoring two items at a hub answering /score with `answer` (retried for 0.3 s)."""

    async def scenario() -> list[ScoreResult]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answer)) as client:
            ctx = RolloutContext(
                router=None,  # type: ignore[arg-type]  # scoring asks only the hub
                reward=RewardClient(client, "http://hub:8001", score_timeout_s=0.3, validate_timeout_s=5),
                tokenizer=None,  # type: ignore[arg-type]
                spec=RunSpec(reward=RewardSpec(terms=[RewardTerm(function="arith_exact")])),
                limit=asyncio.Semaphore(1),
                metrics=RolloutMetrics(),
                rollout=None,  # type: ignore[arg-type]
            )
            return await ctx.score([ScoreItem(id="0", response="3", label="3"), ScoreItem(id="1", response="4")])

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    "status, body",
    [
        (404, {"detail": "Not Found"}),  # a hub without /score, or another service at the URL
        (401, {"error": "missing bearer token"}),  # an auth proxy in front of the hub
        (403, {"error": "forbidden"}),
    ],
)
def test_a_hub_answering_score_with_a_4xx_fails_the_run_naming_the_hub_not_the_spec(status: int, body: dict) -> None:
    """The hub took the spec at submit and answers an item it cannot score in a 200: a 4xx failed the run as
    InvalidInput ("http://hub:8001/score rejected the request"), read as a fault of the run's spec."""
    answer = httpx.Response(status, json=body)
    with pytest.raises(Conflict) as refused:
        _scored_in_a_run(answer)
    assert not isinstance(refused.value, InvalidInput)
    message = str(refused.value)
    assert message.startswith(f"the reward hub at http://hub:8001 answered POST /score with HTTP {status}"), message
    assert answer.text in message, "the start of the hub's answer"
    assert "--reward-url" in message and "proxy" in message


def test_a_hub_failing_score_with_a_5xx_fails_only_the_items() -> None:
    """A hub that is down or overloaded may answer later: its items are ERROR results, the run goes on."""
    results = _scored_in_a_run(httpx.Response(503, json={"error": "restarting"}))
    assert [(r.id, r.status) for r in results] == [(str(i), ScoreStatus.SCORE_STATUS_ERROR) for i in range(2)]
    assert "scoring failed" in results[0].error and "HTTP 503" in results[0].error
