"""Built-in functions through the scoring core and a real worker pool: composition and time limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import json_format

from rlfleet.v1 import reward_pb2
from rlfleet_reward.scoring import Scorer

WithScorer = Callable[..., Any]
OK = reward_pb2.SCORE_STATUS_OK


def test_a_weighted_combination_reports_each_component_and_the_weighted_sum(with_scorer: WithScorer) -> None:
    spec = {
        "terms": [
            {"function": "format", "weight": 0.2, "params": {"pattern": r".*<answer>.*</answer>"}},
            {"function": "numeric", "weight": 1.0},
            {"function": "f1", "weight": 0.5},
        ]
    }
    items = [
        {"id": "right", "response": "<think>2+2</think><answer>4</answer>", "label": "4"},
        {"id": "unformatted", "response": "it is 4 or 5", "label": "5"},
    ]
    request = json_format.ParseDict({"spec": spec, "items": items}, reward_pb2.ScoreRequest())

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(request)

    right, unformatted = with_scorer(body).results
    assert (right.status, unformatted.status) == (OK, OK)
    # f1 of "think 2+2 think answer 4 answer" (tokens: "think22think", "answer4answer") vs "4": no overlap.
    assert dict(right.components) == {
        "format": 1.0,
        "numeric": 1.0,
        "numeric/found": 1.0,
        "f1": 0.0,
        "f1/precision": 0.0,
        "f1/recall": 0.0,
    }
    assert right.score == pytest.approx(0.2 * 1.0 + 1.0 * 1.0 + 0.5 * 0.0)
    assert dict(unformatted.components) == {
        "format": 0.0,
        "numeric": 1.0,
        "numeric/found": 1.0,
        "f1": pytest.approx(1 / 3),
        "f1/precision": pytest.approx(0.2),
        "f1/recall": 1.0,
    }
    assert unformatted.score == pytest.approx(0.2 * 0.0 + 1.0 * 1.0 + 0.5 / 3)


def test_a_math_answer_that_hangs_the_parser_scores_0_and_the_batch_returns(with_scorer: WithScorer) -> None:
    # sympy spends seconds on the tower of powers: the item's 1.5 s limit, shorter than math's own, kills the
    # worker, and `math`, a verifier, scores the response it could not check 0 rather than leave it a TIMEOUT
    # that training would drop.
    items = [
        {"id": "fine", "response": "$\\boxed{\\frac{1}{2}}$", "label": "$0.5$"},
        {"id": "tower", "response": "$\\boxed{9^{9^{9^{9}}}}$", "label": "$4$"},
        {"id": "also-fine", "response": "$\\boxed{4}$", "label": "$4$"},
    ]
    request = json_format.ParseDict(
        {"spec": {"terms": [{"function": "math"}], "timeout_seconds": 1.5}, "items": items}, reward_pb2.ScoreRequest()
    )

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, float]:
        started = time.monotonic()
        response = await scorer.score(request)
        return response, time.monotonic() - started

    response, elapsed = with_scorer(body)
    fine, tower, also_fine = response.results
    assert (fine.status, fine.score) == (OK, 1.0)
    assert (also_fine.status, also_fine.score) == (OK, 1.0)
    assert (tower.status, tower.score, tower.error) == (OK, 0.0, "")
    assert dict(tower.components) == {"math": 0.0, "math/timed_out": 1.0}
    assert elapsed < 4.0
