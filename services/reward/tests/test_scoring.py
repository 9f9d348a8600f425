from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import json_format

from rlfleet.errors import InvalidInput, ResourceExhausted, Unavailable
from rlfleet.v1 import reward_pb2
from rlfleet_reward.admission import Overloaded
from rlfleet_reward.scoring import MAX_PARAMS_PROBLEMS, Scorer

WithScorer = Callable[..., Any]
OK, ERROR, TIMEOUT = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_TIMEOUT


def request(terms: list[dict], items: list[dict], timeout: float | None = None) -> reward_pb2.ScoreRequest:
    spec: dict = {"terms": terms}
    if timeout is not None:
        spec["timeout_seconds"] = timeout
    return json_format.ParseDict({"spec": spec, "items": items}, reward_pb2.ScoreRequest())


def test_weighted_sum_components_and_order(with_scorer: WithScorer) -> None:
    req = request(
        [{"function": "arith_exact", "weight": 2.0}, {"function": "math"}, {"function": "length_parts", "weight": -1}],
        [
            {"id": "right", "response": "82\n", "label": "82"},
            {"id": "wrong", "response": "81", "label": "82"},
            {"id": "spaced", "response": " 7", "label": "7"},
        ],
    )

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(req)

    results = with_scorer(body).results
    assert [r.id for r in results] == ["right", "wrong", "spaced"]
    assert [r.status for r in results] == [OK, OK, OK]
    right, wrong, spaced = results
    assert right.score == pytest.approx(2.0 + 1.0 - 0.5)
    assert dict(right.components) == {
        "arith_exact": 1.0,
        "math": 1.0,
        "length_parts": 0.5,
        "length_parts/chars": 3.0,
        "length_parts/lines": 2.0,
    }
    assert wrong.score == pytest.approx(-0.5)
    assert (wrong.components["arith_exact"], wrong.components["math"]) == (0.0, 0.0)
    assert spaced.score == pytest.approx(2.5)
    assert all(r.seconds > 0 and r.error == "" for r in results)


def test_one_bad_item_never_fails_the_batch(with_scorer: WithScorer) -> None:
    req = request(
        [{"function": "hang_on_label"}, {"function": "arith_exact"}],
        [
            {"id": "ok", "response": "3", "label": "3"},
            {"id": "bad-label", "response": "3", "label": "three"},
            {"id": "hangs", "response": "3", "label": "hang"},
            {"id": "ok-too", "response": "4", "label": "5"},
        ],
        timeout=0.5,
    )

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, float, float | None]:
        started = time.monotonic()
        response = await scorer.score(req)
        elapsed = time.monotonic() - started
        again = await scorer.score(request([{"function": "metadata_value"}], [{"metadata": {"value": "0.25"}}]))
        assert again.results[0].status == OK and again.results[0].score == 0.25
        return (
            response,
            elapsed,
            scorer.metrics.registry.get_sample_value("rlfleet_reward_timeouts_total", {"function": "hang_on_label"}),
        )

    response, elapsed, timeouts = with_scorer(body)
    ok, bad, hangs, ok_too = response.results
    assert (ok.status, ok.score) == (OK, 2.0)
    assert (ok_too.status, ok_too.score, dict(ok_too.components)) == (
        OK,
        1.0,
        {"hang_on_label": 1.0, "arith_exact": 0.0},
    )
    assert (bad.status, bad.score, dict(bad.components)) == (ERROR, 0.0, {})
    assert bad.error == "arith_exact: ValueError: label 'three' is not an integer"
    assert hangs.status == TIMEOUT
    assert hangs.error.startswith("hang_on_label: exceeded its 0.5 s time limit")
    assert hangs.score == 0.0
    assert elapsed < 2.0
    assert timeouts == 1.0


def test_metrics_count_items_by_function_and_status(with_scorer: WithScorer) -> None:
    req = request([{"function": "arith_exact"}, {"function": "raise"}], [{"response": "1", "label": "1"}] * 3)

    async def body(scorer: Scorer) -> dict[str, float | None]:
        await scorer.score(req)
        with pytest.raises(InvalidInput):
            await scorer.score(reward_pb2.ScoreRequest())
        value = scorer.metrics.registry.get_sample_value
        return {
            "arith_ok": value("rlfleet_reward_items_total", {"function": "arith_exact", "status": "ok"}),
            "raise_error": value("rlfleet_reward_items_total", {"function": "raise", "status": "error"}),
            "seconds_count": value("rlfleet_reward_item_seconds_count", {"function": "arith_exact"}),
            "requests_ok": value("rlfleet_reward_requests_total", {"outcome": "ok"}),
            "requests_invalid": value("rlfleet_reward_requests_total", {"outcome": "invalid_input"}),
            "workers": value("rlfleet_reward_pool_workers", {}),
            "busy": value("rlfleet_reward_pool_busy_workers", {}),
        }

    assert with_scorer(body) == {
        "arith_ok": 3.0,
        "raise_error": 3.0,
        "seconds_count": 3.0,
        "requests_ok": 1.0,
        "requests_invalid": 1.0,
        "workers": 2.0,
        "busy": 0.0,
    }


ITEM = {"response": "1", "label": "1"}


@pytest.mark.parametrize(
    ("req", "error", "message"),
    [
        (request([{"function": "arith_exact"}], []), InvalidInput, "items is empty"),
        (request([], [ITEM]), InvalidInput, "spec.terms: name at least one reward function (known: arith_exact, "),
        (
            request([{"function": "arith_exat"}], [ITEM]),
            InvalidInput,
            "spec.terms[0].function: unknown reward function 'arith_exat'; known: arith_exact, ",
        ),
        (
            request([{"function": "math"}, {"function": "math", "weight": 2}], [ITEM]),
            InvalidInput,
            "spec.terms[1].function: 'math' appears twice",
        ),
        (
            request([{"function": "math", "weight": "Infinity"}], [ITEM]),
            InvalidInput,
            "spec.terms[0].weight: must be a finite number, got inf",
        ),
        (
            request([{"function": "math", "params": {"strictly": True}}], [ITEM]),
            InvalidInput,
            "spec.terms[0].params.strictly: Extra inputs are not permitted",
        ),
        (
            request([{"function": "math", "params": {"float_rounding": "six"}}], [ITEM]),
            InvalidInput,
            "spec.terms[0].params.float_rounding:",
        ),
        (
            request([{"function": "arith_exact", "params": {"x": 1}}], [ITEM]),
            InvalidInput,
            "spec.terms[0].params: 'arith_exact' takes no params",
        ),
        (
            request([{"function": "math"}], [ITEM], timeout=0),
            InvalidInput,
            "spec.timeout_seconds: must be > 0 and <= 30, got 0.0",
        ),
        (request([{"function": "math"}], [ITEM], timeout=31), InvalidInput, "must be > 0 and <= 30"),
        (request([{"function": "math"}], [ITEM] * 65), ResourceExhausted, "items has 65 entries; the limit is 64"),
        (
            request([{"function": "math"}], [{"id": "a"}, {"id": "b"}, {}, {}, {"id": "a"}]),
            InvalidInput,
            "items[4].id: 'a' is also the id of items[0]; results carry their item's id",
        ),
        (
            request([{"function": "math"}], [{"id": "x" * 5000}] * 2),
            InvalidInput,
            f"items[1].id: '{'x' * 100}...' is also the id of items[0]",
        ),
    ],
)
def test_bad_requests_are_rejected_naming_the_field(
    with_scorer: WithScorer, req: reward_pb2.ScoreRequest, error: type[Exception], message: str
) -> None:
    async def body(scorer: Scorer) -> None:
        with pytest.raises(error) as raised:
            await scorer.score(req)
        assert message in str(raised.value)

    with_scorer(body, workers=1)


def test_items_without_ids_are_scored_in_request_order(with_scorer: WithScorer) -> None:
    """An empty id is no id, so any number of items may leave it out: results come in request order."""
    req = request([{"function": "arith_exact"}], [{"response": "1", "label": "1"}, {}, {"id": "a"}, {"response": "2"}])

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(req)

    results = with_scorer(body, workers=1).results
    assert [(r.id, r.status) for r in results] == [("", OK), ("", ERROR), ("a", ERROR), ("", ERROR)]
    assert results[0].score == 1.0


def test_validate_spec_reports_every_problem_score_would_refuse_by_field(with_scorer: WithScorer) -> None:
    spec = {
        "terms": [
            {"function": "exact", "params": {"bogus": 1, "strip": "maybe"}},
            {"function": "arith_exact", "params": {"x": 1}},
            {"function": "exact"},
            {"function": "nope"},
            {"function": "math", "weight": "NaN"},
        ],
        "timeout_seconds": 1000,
    }
    bad = json_format.ParseDict({"spec": spec}, reward_pb2.ValidateSpecRequest())
    good = json_format.ParseDict(
        {"spec": {"terms": [{"function": "exact", "params": {"strip": False}}, {"function": "arith_exact"}]}},
        reward_pb2.ValidateSpecRequest(),
    )

    async def body(scorer: Scorer) -> tuple[reward_pb2.ValidateSpecResponse, reward_pb2.ValidateSpecResponse, str]:
        with pytest.raises(InvalidInput) as raised:
            await scorer.score(reward_pb2.ScoreRequest(spec=bad.spec, items=[reward_pb2.ScoreItem(response="1")]))
        return scorer.validate_spec(bad), scorer.validate_spec(good), str(raised.value)

    found, clean, refusal = with_scorer(body, workers=1)
    problems = {(p.field, p.message.split(";")[0].split(",")[0]) for p in found.problems}
    assert problems == {
        ("terms[0].params.bogus", "Extra inputs are not permitted"),
        ("terms[0].params.strip", "Input should be a valid boolean"),
        ("terms[1].params", "'arith_exact' takes no params"),
        ("terms[2].function", "'exact' appears twice"),
        ("terms[3].function", "unknown reward function 'nope'"),
        ("terms[4].weight", "must be a finite number"),
        ("timeout_seconds", "must be > 0 and <= 30"),
    }
    assert list(clean.problems) == []
    # Score refuses the same spec for the same reasons, each field under `spec.`.
    assert refusal == "; ".join(f"spec.{p.field}: {p.message}" for p in found.problems)


def test_non_finite_params_are_refused_naming_the_field(with_scorer: WithScorer) -> None:
    """JSON has no NaN or infinity, but the JSON decoder and protobuf's Struct take them; MessageToDict then
    raised ValueError, a 500 / INTERNAL."""
    terms = [
        {"function": "judge", "params": {"scale": float("inf")}},
        {"function": "format", "params": {"pattern": "x", "extra": [1, {"deep": float("nan")}]}},
    ]
    req = request(terms, [ITEM])

    async def body(scorer: Scorer) -> tuple[str, list[tuple[str, str]]]:
        with pytest.raises(InvalidInput) as raised:
            await scorer.score(req)
        problems = scorer.validate_spec(reward_pb2.ValidateSpecRequest(spec=req.spec)).problems
        return str(raised.value), [(p.field, p.message) for p in problems]

    refusal, problems = with_scorer(body, workers=1)
    assert problems == [
        ("terms[0].params.scale", "must be a finite number, got inf"),
        ("terms[1].params.extra.1.deep", "must be a finite number, got nan"),
    ]
    assert refusal == "; ".join(f"spec.{field}: {message}" for field, message in problems)


def test_more_terms_than_functions_is_one_problem_not_one_per_term(with_scorer: WithScorer) -> None:
    """Each term was checked, and each unknown one gave a problem naming every function: an 8 MiB spec of
    unknown terms answered 88 MiB after 15 s on the event loop, and /score refused it with a 77 MiB message."""
    spec = reward_pb2.RewardSpec(terms=[reward_pb2.RewardTerm(function=f"f{i}") for i in range(10_000)])

    async def body(scorer: Scorer) -> tuple[list[tuple[str, str]], str, int]:
        with pytest.raises(InvalidInput) as raised:
            await scorer.score(reward_pb2.ScoreRequest(spec=spec, items=[reward_pb2.ScoreItem(response="1")]))
        problems = scorer.validate_spec(reward_pb2.ValidateSpecRequest(spec=spec)).problems
        return [(p.field, p.message) for p in problems], str(raised.value), len(scorer.registry)

    problems, refusal, functions = with_scorer(body, workers=1)
    [(field, message)] = problems
    assert field == "terms" and message.startswith(f"has 10000 entries, but each reward function may appear once and "
                                                   f"the hub has {functions} (known: ")  # fmt: skip
    assert len(refusal) < 2000, len(refusal)


def test_a_terms_params_problems_are_listed_up_to_a_bound_and_the_rest_counted(with_scorer: WithScorer) -> None:
    """Each unknown or non-finite param was a problem of its own, each named: a spec of 100,000 unknown params got
    100,000 problems from /validate, and /score built its refusal from all of them."""
    unknown = {f"p{i:06d}": 0 for i in range(100_000)}
    terms = [
        {"function": "exact", "params": unknown},
        {"function": "arith_exact", "params": unknown},
        {"function": "judge", "params": {f"p{i:04d}": float("nan") for i in range(1000)}},
    ]
    spec = json_format.ParseDict({"terms": terms}, reward_pb2.RewardSpec())

    async def body(scorer: Scorer) -> tuple[list[tuple[str, str]], str]:
        with pytest.raises(InvalidInput) as raised:
            await scorer.score(reward_pb2.ScoreRequest(spec=spec, items=[reward_pb2.ScoreItem(response="1")]))
        problems = scorer.validate_spec(reward_pb2.ValidateSpecRequest(spec=spec)).problems
        return [(p.field, p.message) for p in problems], str(raised.value)

    problems, refusal = with_scorer(body, workers=1)
    assert len(problems) == 2 * (MAX_PARAMS_PROBLEMS + 1) + 1, len(problems)
    listed = problems[:MAX_PARAMS_PROBLEMS]
    assert all(f.removeprefix("terms[0].params.") in unknown for f, _ in listed), listed
    assert {message for _, message in listed} == {"Extra inputs are not permitted"}
    assert problems[MAX_PARAMS_PROBLEMS] == ("terms[0].params", "99990 more problems, not listed; fix these first")
    field, message = problems[MAX_PARAMS_PROBLEMS + 1]
    assert field == "terms[1].params"
    assert message == (
        f"'arith_exact' takes no params, got 100000: {sorted(unknown)[:MAX_PARAMS_PROBLEMS]} and 99990 more"
    )
    assert problems[-1] == ("terms[2].params", "990 more problems, not listed; fix these first")
    assert problems[-MAX_PARAMS_PROBLEMS - 1 : -1] == [
        (f"terms[2].params.p{i:04d}", "must be a finite number, got nan") for i in range(MAX_PARAMS_PROBLEMS)
    ]
    assert refusal == "; ".join(f"spec.{field}: {message}" for field, message in problems)
    assert len(refusal) < 3000, len(refusal)


def test_a_weighted_sum_that_overflows_is_an_item_error(with_scorer: WithScorer) -> None:
    req = request(
        [{"function": "arith_exact", "weight": 1e308}, {"function": "exact", "weight": 1e308}],
        [{"id": "both", "response": "1", "label": "1"}, {"id": "one", "response": "1", "label": "01"}],
    )

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(req)

    both, one = with_scorer(body, workers=1).results
    assert (both.status, both.score, dict(both.components)) == (ERROR, 0.0, {})
    assert both.error.startswith("the weighted sum of the terms' scores is inf, past the largest reward a sample")
    # Finite, but past what a sample may carry: scored OK, its group would have failed the run at the stream.
    assert (one.status, one.score) == (ERROR, 0.0) and "is 1e+308, past" in one.error


def test_without_a_wait_a_request_past_the_pending_jobs_limit_is_refused_while_the_hub_is_busy(
    with_scorer: WithScorer,
) -> None:
    slow = request([{"function": "sleep", "params": {"seconds": 0.4}}], [ITEM] * 2)
    # 3 items x 2 terms: 6 jobs, more than the limit of 4 on their own, so taken only by an idle hub.
    more = request([{"function": "arith_exact"}, {"function": "exact"}], [ITEM] * 3)

    async def body(scorer: Scorer) -> dict[str, Any]:
        busy = asyncio.create_task(scorer.score(slow))
        await asyncio.sleep(0.1)
        with pytest.raises(Overloaded) as refused:
            await scorer.score(more)
        held = scorer.admission.pending
        await busy
        taken = await scorer.score(more)
        value = scorer.metrics.registry.get_sample_value
        return {
            "refusal": str(refused.value),
            "held": held,
            "taken": [r.status for r in taken.results],
            "pending after": scorer.admission.pending,
            "overloaded": value("rlfleet_reward_requests_total", {"outcome": "overloaded"}),
            "ok": value("rlfleet_reward_requests_total", {"outcome": "ok"}),
        }

    outcome = with_scorer(body, workers=1, max_pending_jobs=4, admission_wait_seconds=0)
    assert "scoring 2 jobs (items x terms) and this request adds 6, past its limit of 4 (max_pending_jobs)" in (
        outcome.pop("refusal")
    )
    assert outcome == {"held": 2, "taken": [OK] * 3, "pending after": 0, "overloaded": 1.0, "ok": 2.0}


def test_a_request_past_the_pending_jobs_limit_waits_for_room_and_is_scored(with_scorer: WithScorer) -> None:
    slow = request([{"function": "sleep", "params": {"seconds": 0.4}}], [ITEM] * 2)
    more = request([{"function": "arith_exact"}, {"function": "exact"}], [ITEM] * 3)

    async def body(scorer: Scorer) -> dict[str, Any]:
        value = scorer.metrics.registry.get_sample_value
        busy = asyncio.create_task(scorer.score(slow))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(scorer.score(more))
        await asyncio.sleep(0.05)
        seen_waiting = (
            value("rlfleet_reward_admission_pending_jobs", {}),
            value("rlfleet_reward_admission_waiting_requests", {}),
        )
        await asyncio.wait_for(busy, 10)
        taken = await asyncio.wait_for(waiting, 10)
        return {
            "while waiting (pending jobs, waiting requests)": seen_waiting,
            "taken": [r.status for r in taken.results],
            "after": (scorer.admission.pending, scorer.admission.waiting),
            "ok": value("rlfleet_reward_requests_total", {"outcome": "ok"}),
            "overloaded": value("rlfleet_reward_requests_total", {"outcome": "overloaded"}),
        }

    assert with_scorer(body, workers=1, max_pending_jobs=4, admission_wait_seconds=10) == {
        "while waiting (pending jobs, waiting requests)": (2.0, 1.0),
        "taken": [OK] * 3,
        "after": (0, 0),
        "ok": 2.0,
        "overloaded": 0.0,
    }


def test_an_unexpected_fault_is_counted_as_internal(with_scorer: WithScorer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(scorer: Scorer) -> float | None:
        async def broken(*args: object) -> None:
            raise RuntimeError("a bug of ours")

        monkeypatch.setattr(scorer.pool, "run", broken)
        with pytest.raises(RuntimeError):
            await scorer.score(request([{"function": "exact"}], [ITEM]))
        assert scorer.admission.pending == 0
        return scorer.metrics.registry.get_sample_value("rlfleet_reward_requests_total", {"outcome": "internal"})

    assert with_scorer(body, workers=1) == 1.0


def test_a_term_that_fails_the_request_stops_its_other_terms(
    with_scorer: WithScorer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool down (Unavailable) fails the request at once; its network-bound term must not go on calling out,
    # holding io slots that other requests need, for answers nobody will read.
    async def body(scorer: Scorer) -> float | None:
        async def down(*args: object) -> None:
            raise Unavailable("no reward worker is running")

        monkeypatch.setattr(scorer.pool, "run", down)
        terms: list[dict] = [{"function": "wait", "params": {"seconds": 5}}, {"function": "exact"}]
        with pytest.raises(Unavailable):
            await scorer.score(request(terms, [ITEM] * 3, timeout=10.0))
        return scorer.metrics.registry.get_sample_value("rlfleet_reward_io_calls_in_flight")

    assert with_scorer(body, workers=1) == 0.0


def test_params_reach_the_function_validated(with_scorer: WithScorer) -> None:
    req = request([{"function": "sleep", "params": {"seconds": 0.3}}], [ITEM], timeout=0.2)

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(req)

    assert with_scorer(body, workers=1).results[0].status == TIMEOUT


def test_list_functions_declares_inputs(with_scorer: WithScorer) -> None:
    async def body(scorer: Scorer) -> reward_pb2.ListFunctionsResponse:
        return scorer.list_functions()

    infos = {f.name: f for f in with_scorer(body, workers=1).functions}
    assert list(infos["arith_exact"].inputs) == ["response", "label"]
    assert list(infos["metadata_value"].inputs) == ["metadata"]
    assert "math-verify" in infos["math"].description


def test_an_async_function_s_own_timeout_error_is_its_error_not_the_hub_s_limit(with_scorer: WithScorer) -> None:
    req = request([{"function": "own_timeout"}], [{"response": "3"}], timeout=5.0)

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, float | None]:
        response = await scorer.score(req)
        timeouts = scorer.metrics.registry.get_sample_value(
            "rlfleet_reward_timeouts_total", {"function": "own_timeout"}
        )
        return response, timeouts

    response, timeouts = with_scorer(body)
    (result,) = response.results
    assert (result.status, result.error) == (
        ERROR,
        "own_timeout: TimeoutError: the upstream did not answer within its 2 s",
    )
    assert timeouts == 0.0
