"""Held-out evaluation in process, with a fake router and a fake hub that weighs terms as the reward hub does:
a penalty term (negative weight) does not lower the bar for full marks, and samples that failed are counted
as wrong and reported as failed."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from rollout_test_support import spec_json

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import resolve
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.evaluation import evaluate
from rlfleet_rollout.group_producer import RolloutContext, full_marks
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.prompt_tokenizer import load_tokenizer
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.router_client import Completion

PENALISED = {
    "terms": [{"function": "arith_exact"}, {"function": "format_regex", "weight": -1.0, "params": {"pattern": "x"}}]
}


class Answers:
    """Answers the prompts of each request, in order, with the next of `answers`; refuses request `refuse`."""

    def __init__(self, answers: list[str], refuse: int | None = None) -> None:
        self.answers = iter(answers)
        self.requests = 0
        self.refuse = refuse

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        self.requests += 1
        if self.requests == self.refuse:
            raise InvalidInput("router rejected the request (HTTP 400)")
        stop = FinishReason.FINISH_REASON_STOP
        return [Completion((5,), (-0.1,), next(self.answers), stop, 1) for _ in prompts]


class WeighingHub:
    """arith_exact (the answer is the label) and format_regex (an "x" in it), summed with their weights as
    the reward hub's `_combine` does; a response "?" cannot be scored."""

    async def score(self, spec: RewardSpec, items: list[ScoreItem]) -> list[ScoreResult]:
        results = []
        for item in items:
            if item.response == "?":
                results.append(ScoreResult(id=item.id, status=ScoreStatus.SCORE_STATUS_ERROR, error="bad response"))
                continue
            values = {
                "arith_exact": float(item.response.rstrip("x") == item.label),
                "format_regex": float("x" in item.response),
            }
            score = sum(term.weight * values[term.function] for term in spec.terms)
            results.append(ScoreResult(id=item.id, status=ScoreStatus.SCORE_STATUS_OK, score=score))
        return results


def _context(tokenizer_dir: Path, router: Answers, reward: dict[str, Any] | None = None) -> RolloutContext:
    spec = resolve(json_format.ParseDict(spec_json(tokenizer_dir, **({"reward": reward} if reward else {})), RunSpec()))
    return RolloutContext(
        router=router,  # type: ignore[arg-type]
        reward=WeighingHub(),  # type: ignore[arg-type]
        tokenizer=load_tokenizer(str(tokenizer_dir)),
        spec=spec,
        limit=asyncio.Semaphore(4),
        metrics=RolloutMetrics(),
        rollout=RolloutRegistry.from_entry_points().function(spec.rollout.function),
    )


def test_a_penalty_term_does_not_lower_full_marks(tokenizer_dir: Path) -> None:
    """With arith_exact at 1.0 and a penalty at -1.0, full marks were their sum, 0: a wrong answer that earned
    no penalty (score 0) counted as correct."""
    ctx = _context(tokenizer_dir, Answers(["3", "0", "3x"]), PENALISED)
    assert full_marks(ctx.spec.reward) == pytest.approx(1.0, abs=1e-5)
    prompts = [Prompt(prompt="1+2=", answer="3")] * 3  # right, wrong, right but penalised
    result = asyncio.run(evaluate(ctx, "run-1", 0, prompts, batch_size=8, trainer_version=0))
    assert result.accuracy == pytest.approx(1 / 3) and result.failed == 0


def test_failed_samples_count_as_wrong_and_are_reported(tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A refused request (4 samples) and a response the hub cannot score: wrong, as before, but no longer
    silently: the EvalResult and the log say how many failed."""
    ctx = _context(tokenizer_dir, Answers(["3", "?", "3", "3"], refuse=2))
    prompts = [Prompt(prompt="1+2=", answer="3")] * 8
    with caplog.at_level(logging.WARNING, logger="rlfleet_rollout.evaluation"):
        result = asyncio.run(evaluate(ctx, "run-1", 0, prompts, batch_size=4, trainer_version=0))
    assert result.accuracy == pytest.approx(3 / 8) and result.failed == 5
    assert result.mean_length == 1.0 and result.size == 8 and result.k == 1
    assert "5 of 8 samples failed" in caplog.text and "HTTP 400" in caplog.text and "bad response" in caplog.text
    assert json_format.MessageToDict(result)["failed"] == 5  # what the REST API shows
