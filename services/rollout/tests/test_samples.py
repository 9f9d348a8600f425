"""Turning engine answers into Samples: tolerant parsing and statuses."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from test_partial_rollout import _context

from rlfleet.char_tokenizer import vocabulary
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.samples_pb2 import FinishReason, SampleStatus
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.group_producer import GroupRequest, build_sample
from rlfleet_rollout.router_client import Completion, parse_completion, parse_weight_version
from rlfleet_rollout.single_turn import single_turn


def _answer(output_ids: list[int], logprobs: list[float], finish: str = "stop", version: object = "3") -> dict:
    return {
        "text": "12",
        "output_ids": output_ids,
        "meta_info": {
            "finish_reason": {"type": finish},
            "weight_version": version,
            "cached_tokens": 2,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids, strict=False)],
        },
    }


def test_completions_keep_what_the_engine_returned() -> None:
    with_eos = parse_completion(_answer([20, 21, 1], [-0.5, -0.25, -0.125]))
    assert with_eos.output_ids == (20, 21, 1) and with_eos.logprobs == (-0.5, -0.25, -0.125)
    assert with_eos.weight_version == 3 and with_eos.cached_tokens == 2 and not with_eos.error
    without_eos = parse_completion(_answer([20, 21], [-0.5, -0.25], finish="length", version=4))
    assert without_eos.finish_reason == FinishReason.FINISH_REASON_LENGTH and without_eos.weight_version == 4
    assert parse_weight_version("default") is None and parse_weight_version(True) is None


def test_unusable_completions_carry_an_error() -> None:
    short = parse_completion(_answer([20, 21, 1], [-0.5]))
    assert "3 output ids but 1 logprobs" in short.error and short.output_ids == ()
    aborted = parse_completion(_answer([], [], finish="abort"))
    assert aborted.finish_reason == FinishReason.FINISH_REASON_ABORT and "aborted" in aborted.error
    assert parse_completion({"text": "x"}).error
    assert parse_completion("nonsense").error


def test_sample_status_follows_finish_reason_and_score() -> None:
    ok = ScoreResult(id="0", status=ScoreStatus.SCORE_STATUS_OK, score=1.0, components={"arith_exact": 1.0})
    done = Completion(
        output_ids=(20, 1), logprobs=(-0.1, -0.2), text="1", finish_reason=FinishReason.FINISH_REASON_STOP
    )
    sample = build_sample("g/0", 0, [5, 6], "1+0=", done, "1", ok, fallback_version=7)
    assert sample.status == SampleStatus.SAMPLE_STATUS_OK and sample.reward == 1.0
    assert list(sample.loss_mask) == [1, 1] and list(sample.weight_versions) == [7]
    truncated = Completion(output_ids=(20,), logprobs=(-0.1,), finish_reason=FinishReason.FINISH_REASON_LENGTH)
    assert build_sample("g/1", 1, [5], "", truncated, "1", ok, 0).status == SampleStatus.SAMPLE_STATUS_TRUNCATED
    timeout = ScoreResult(id="0", status=ScoreStatus.SCORE_STATUS_TIMEOUT)
    failed = build_sample("g/2", 2, [5], "", done, "1", timeout, 0)
    assert failed.status == SampleStatus.SAMPLE_STATUS_FAILED and failed.reward == 0.0
    assert "SCORE_STATUS_TIMEOUT" in failed.error
    broken = build_sample("g/3", 3, [5], "", Completion(error="generation failed: down"), "", None, 0)
    assert broken.status == SampleStatus.SAMPLE_STATUS_FAILED and broken.error == "generation failed: down"
    assert len(broken.response_token_ids) == len(broken.rollout_logprobs) == len(broken.loss_mask) == 0


class Answers:
    """Answers every request with `answers`, SGLang's JSON, as the router would."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = answers

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        return [parse_completion(answer) for answer in self.answers]


class SeesResponses:
    def __init__(self) -> None:
        self.responses: list[str] = []

    async def score(self, spec: RewardSpec, items: list[ScoreItem]) -> list[ScoreResult]:
        self.responses += [item.response for item in items]
        return [ScoreResult(id=i.id, status=ScoreStatus.SCORE_STATUS_OK, score=0.0) for i in items]


def test_an_empty_text_is_the_response_and_only_a_missing_one_is_decoded(tokenizer_dir: Path) -> None:
    """A response that was only a stop string comes back with its tokens and the text "" (the engine cut the
    stop string from it): "" was taken for no text, and the hub scored the stop string decoded."""
    vocab = vocabulary()
    stop_only = {**_answer([vocab["="]], [-0.5]), "text": ""}
    without_text = {
        key: value for key, value in _answer([vocab["1"], vocab["2"]], [-0.5, -0.25]).items() if key != "text"
    }
    assert parse_completion(stop_only).text == "" and parse_completion(without_text).text is None
    hub = SeesResponses()
    ctx = replace(_context(tokenizer_dir, Answers(stop_only, without_text), "finish"), reward=hub)
    request = GroupRequest("run-1", "run-1/0/p0", 0, Prompt(prompt="1+2=", answer="3"), 0)
    group = asyncio.run(single_turn(ctx, request))
    assert hub.responses == ["", "12"]
    assert [s.response_text for s in group.samples] == ["", "12"]
