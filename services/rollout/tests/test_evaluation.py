"""Held-out evaluation in process, with a fake router and a fake hub that weighs terms as the reward hub does:
a penalty term (negative weight) does not lower the bar for full marks, samples that failed are counted
as wrong and reported as failed, and a held-out prompt training would skip as too long is left out and counted."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from rollout_test_support import spec_json

from rlfleet.errors import InvalidInput, Unavailable
from rlfleet.run_spec import resolve
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.runs_pb2 import EvalResult, Run, RunSpec
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.evaluation import evaluate
from rlfleet_rollout.group_producer import RolloutContext, full_marks
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.prompt_tokenizer import load_tokenizer
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.router_client import Completion
from rlfleet_rollout.run_events import describe_change

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


def _context(tokenizer_dir: Path, router: Answers | ByCell, reward: dict[str, Any] | None = None) -> RolloutContext:
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


class ByCell:
    """Answers held-out prompt `index`'s sample `j` (read from the request id) with `answers[(index, j)]`, "0" if
    absent; records the sampling parameters of every sample."""

    def __init__(self, answers: dict[tuple[int, int], str]) -> None:
        self.answers = answers
        self.sampling: dict[tuple[int, int], dict[str, Any]] = {}

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        out = []
        for rid, params in zip(rids, sampling, strict=True):
            index, j = (int(part) for part in rid.split("@")[0].split("/")[-2:])
            self.sampling[index, j] = params
            out.append(Completion((5,), (-0.1,), self.answers.get((index, j), "0"), FinishReason.FINISH_REASON_STOP, 1))
        return out


def test_pass_at_k_is_the_share_of_prompts_with_a_correct_sample_and_accuracy_that_of_samples(
    tokenizer_dir: Path,
) -> None:
    """k = 3 over requests of two prompts each: accuracy is over the 15 samples, pass@k over the 5 prompts (a prompt
    counted once however many of its samples are right, and wrong when its one right-looking sample failed); the
    samples are drawn with the run's sampling and seeds of their own, the same at every evaluation."""
    right = {(0, 0): "3", (2, 0): "3", (2, 1): "3", (2, 2): "3", (3, 2): "3", (4, 1): "?"}
    router = ByCell(right)
    ctx = _context(tokenizer_dir, router)
    ctx.spec.schedule.eval_samples = 3
    prompts = [Prompt(prompt="1+2=", answer="3")] * 5
    result = asyncio.run(evaluate(ctx, "run-1", 4, prompts, batch_size=6, trainer_version=0))
    assert (result.k, result.size, result.failed) == (3, 5, 1)
    assert result.accuracy == pytest.approx(5 / 15) and result.pass_at_k == pytest.approx(3 / 5)
    assert {params["temperature"] for params in router.sampling.values()} == {ctx.spec.rollout.sampling.temperature}
    seeds = {cell: params["sampling_seed"] for cell, params in router.sampling.items()}
    assert len(set(seeds.values())) == 15
    asyncio.run(evaluate(ctx, "run-1", 8, prompts, batch_size=6, trainer_version=0))
    assert {cell: params["sampling_seed"] for cell, params in router.sampling.items()} == seeds
    ctx.spec.schedule.eval_samples = 1  # one greedy answer per prompt: pass@1 is the accuracy
    result = asyncio.run(evaluate(ctx, "run-1", 8, prompts, batch_size=6, trainer_version=0))
    assert router.sampling[2, 0]["temperature"] == 0.0 and "sampling_seed" not in router.sampling[2, 0]
    assert result.accuracy == result.pass_at_k == pytest.approx(2 / 5)  # samples 0 of prompts 0 and 2


def test_a_held_out_prompt_over_max_prompt_tokens_is_left_out_and_counted(tokenizer_dir: Path) -> None:
    """Training skips a prompt longer than rollout.max_prompt_tokens ("prompt_too_long"); evaluation sent it, and
    its answer moved accuracy and pass@k. It is not sent now, no figure counts it, `prompts_too_long` does, and the
    other prompts keep their request ids and seeds."""
    right = {(i, j): "3" for i in (0, 2, 3) for j in range(3)}
    router = ByCell(right)
    ctx = _context(tokenizer_dir, router)
    ctx.spec.schedule.eval_samples = 3
    prompts = [Prompt(prompt="1+2=", answer="3")] * 4
    prompts[1] = Prompt(prompt="1+2=" * 5, answer="3")  # 20 characters; the others fit in 10 tokens
    asyncio.run(evaluate(ctx, "run-1", 0, prompts, batch_size=6, trainer_version=0))
    seeds = {cell: params["sampling_seed"] for cell, params in router.sampling.items()}
    assert len(seeds) == 12

    router.sampling.clear()
    ctx.spec.rollout.max_prompt_tokens = 10
    result = asyncio.run(evaluate(ctx, "run-1", 2, prompts, batch_size=6, trainer_version=0))
    assert (result.size, result.prompts_too_long, result.k, result.failed) == (3, 1, 3, 0)
    assert result.accuracy == 1.0 and result.pass_at_k == 1.0
    assert {cell: params["sampling_seed"] for cell, params in router.sampling.items()} == {
        cell: seed for cell, seed in seeds.items() if cell[0] != 1
    }
    assert json_format.MessageToDict(result)["promptsTooLong"] == 1  # what the REST API shows


def test_an_evaluation_of_only_prompts_over_max_prompt_tokens_names_the_field(tokenizer_dir: Path) -> None:
    """Every held-out prompt past the limit leaves nothing to evaluate: an error that says how to fix the spec,
    not figures over prompts training never takes."""
    ctx = _context(tokenizer_dir, Answers(["3"] * 4))
    ctx.spec.rollout.max_prompt_tokens = 10
    prompts = [Prompt(prompt="1+2=" * 5, answer="3")] * 2
    with pytest.raises(InvalidInput, match=r"rollout\.max_prompt_tokens: .*2 held-out prompts.* longer than 10"):
        asyncio.run(evaluate(ctx, "run-1", 0, prompts, batch_size=8, trainer_version=0))


def test_an_evaluation_none_of_whose_samples_could_be_scored_is_no_result(tokenizer_dir: Path) -> None:
    """The engines answered but the hub scored nothing: the evaluation was recorded with accuracy 0 (a model that
    answers nothing right), and never repeated at that step. As with no answer at all, it is an error instead."""
    ctx = _context(tokenizer_dir, Answers(["?"] * 4))
    prompts = [Prompt(prompt="1+2=", answer="3")] * 4
    with pytest.raises(
        Unavailable, match=r"evaluation at step 5: none of the 4 samples could be generated and scored.*bad response"
    ):
        asyncio.run(evaluate(ctx, "run-1", 5, prompts, batch_size=8, trainer_version=0))


def test_a_watch_event_of_an_evaluation_says_how_many_prompts_were_too_long() -> None:
    before = Run(id="run-1")
    after = Run(id="run-1", evals=[EvalResult(step=2, size=3, accuracy=1.0, prompts_too_long=1)])
    assert describe_change(before, after) == (
        "eval at step 2: accuracy 1.000 on 3 held-out prompts (1 more left out as too long)"
    )
    after.evals[0].prompts_too_long = 0
    assert describe_change(before, after) == "eval at step 2: accuracy 1.000 on 3 held-out prompts"
