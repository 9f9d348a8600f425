"""What an item that runs out of time scores: a TIMEOUT, or, for a verifier, its `timeout_score` marked
`timed_out`; through the scoring core and a real worker pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import json_format

from rlfleet.v1 import reward_pb2
from rlfleet_reward.scoring import Scorer

WithScorer = Callable[..., Any]
OK, ERROR, TIMEOUT = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_TIMEOUT
REPLACED = "replaced worker"


def request(terms: list[dict], items: list[dict], timeout: float) -> reward_pb2.ScoreRequest:
    spec = {"terms": terms, "timeout_seconds": timeout}
    return json_format.ParseDict({"spec": spec, "items": items}, reward_pb2.ScoreRequest())


def fractions(count: int, tail: str = "") -> str:
    """A boxed sum of `count` fractions: math-verify's parser takes seconds on a few thousand."""
    return "\\boxed{" + "+".join(f"\\frac{{{i}}}{{{i + 1}}}" for i in range(1, count)) + tail + "}"


def test_a_verifier_past_the_item_limit_scores_its_timeout_score_marked_timed_out(
    with_scorer: WithScorer, caplog: pytest.LogCaptureFixture
) -> None:
    req = request(
        [{"function": "verify_or_hang"}, {"function": "length_parts"}],
        [{"id": "hangs", "response": "3", "label": "hang"}, {"id": "fine", "response": "3", "label": "3"}],
        timeout=0.5,
    )

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, dict[str, float | None]]:
        response = await scorer.score(req)
        value = scorer.metrics.registry.get_sample_value
        counted = {
            "timeouts": value("rlfleet_reward_timeouts_total", {"function": "verify_or_hang"}),
            "timeout_items": value("rlfleet_reward_items_total", {"function": "verify_or_hang", "status": "timeout"}),
        }
        again = await scorer.score(request([{"function": "verify_or_hang"}], [{"label": "ok"}], timeout=0.5))
        assert (again.results[0].status, again.results[0].score) == (OK, 1.0)  # a fresh worker serves
        return response, counted

    with caplog.at_level(logging.WARNING):
        response, counted = with_scorer(body)
    hangs, fine = response.results
    # Still OK: the other term's score counts, and the sample trains, on a 0 for the verifier.
    assert (hangs.status, hangs.score, hangs.error) == (OK, 0.5, "")
    length = {"length_parts": 0.5, "length_parts/chars": 1.0, "length_parts/lines": 1.0}
    assert dict(hangs.components) == {"verify_or_hang": 0.0, "verify_or_hang/timed_out": 1.0, **length}
    assert (fine.status, fine.score, dict(fine.components)) == (OK, 1.5, {"verify_or_hang": 1.0, **length})
    assert counted == {"timeouts": 1.0, "timeout_items": 1.0}  # visible as a timeout all the same
    assert REPLACED in caplog.text  # the hang was in C code as far as signals go: only a kill ends it


def test_a_function_without_a_timeout_score_still_times_out(with_scorer: WithScorer) -> None:
    req = request([{"function": "hang_on_label"}], [{"label": "hang"}], timeout=0.5)

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(req)

    (result,) = with_scorer(body).results
    assert (result.status, result.error) == (TIMEOUT, "hang_on_label: exceeded its 0.5 s time limit")


def test_a_function_s_own_limit_ends_the_item_as_a_timeout_and_keeps_its_worker(
    with_scorer: WithScorer, caplog: pytest.LogCaptureFixture
) -> None:
    req = request(
        [{"function": "own_limit", "params": {"limit": 0.2}}], [{"response": "a"}, {"response": "b"}], timeout=5.0
    )
    verifier = request([{"function": "verify_own_limit", "params": {"limit": 0.2}}], [{"response": "a"}], timeout=5.0)

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, reward_pb2.ScoreResponse, float]:
        started = time.monotonic()
        plain = await scorer.score(req)
        elapsed = time.monotonic() - started
        return plain, await scorer.score(verifier), elapsed

    with caplog.at_level(logging.WARNING):
        plain, scored, elapsed = with_scorer(body)
    for result in plain.results:
        assert (result.status, result.error) == (TIMEOUT, "own_limit: the spin ran past its 0.2 s limit")
        assert result.seconds == pytest.approx(0.2, abs=0.15)
    (result,) = scored.results
    assert (result.status, result.score) == (OK, 0.0)
    assert dict(result.components) == {"verify_own_limit": 0.0, "verify_own_limit/timed_out": 1.0}
    assert elapsed < 2.0  # within its own limit, far inside the item's 5 s
    assert REPLACED not in caplog.text  # the worker goes on serving


def test_a_math_response_that_would_spend_math_verify_s_limits_scores_0_within_its_own(
    with_scorer: WithScorer, caplog: pytest.LogCaptureFixture
) -> None:
    # A label with a percent sign makes math compare twice, once without it: math-verify's own 5 s limit on each
    # parse of a response it cannot read passed the hub's 10 s default together, and the item was a TIMEOUT.
    req = request(
        [{"function": "math"}],
        [{"id": "slow", "response": fractions(6000), "label": "7\\%"}, {"id": "fine", "response": "7", "label": "7"}],
        timeout=10.0,
    )

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, float]:
        started = time.monotonic()
        response = await scorer.score(req)
        return response, time.monotonic() - started

    with caplog.at_level(logging.WARNING):
        response, elapsed = with_scorer(body)
    slow, fine = response.results
    assert (slow.status, slow.score) == (OK, 0.0), slow.error
    assert dict(slow.components) == {"math": 0.0, "math/timed_out": 1.0}
    assert (fine.status, fine.score) == (OK, 1.0)
    assert elapsed < 8.0  # math's own 5 s limit, not the item's 10 s
    assert REPLACED not in caplog.text


def test_a_math_label_that_cannot_be_read_in_time_is_an_error_not_a_0(with_scorer: WithScorer) -> None:
    req = request(
        [{"function": "math", "params": {"timeout_seconds": 0.2}}],
        [{"response": "7", "label": fractions(6000)}],
        timeout=5.0,
    )

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(req)

    (result,) = with_scorer(body).results
    assert result.status == ERROR
    assert "could not read the label" in result.error and "timeout_seconds (0.2 s)" in result.error
