"""Partial rollouts (rollout.on_weight_update "abort_resume"): joining an aborted completion with its
continuation, and single_turn and multi_turn across a real weight update (a `sim` engine behind the real
router)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from rollout_test_support import spec_json

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.run_spec import resolve
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import FinishReason, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.environment import ReplyPool
from rlfleet_rollout.group_producer import GroupRequest, RolloutContext
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.partial_rollout import (
    MAX_RESUMES,
    continued_seed,
    generate_resuming,
    join,
    stop_across_the_cut,
)
from rlfleet_rollout.prompt_tokenizer import load_tokenizer
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.router_client import Completion, RouterClient, parse_completion

ABORT = FinishReason.FINISH_REASON_ABORT
LENGTH = FinishReason.FINISH_REASON_LENGTH
MAX_NEW_TOKENS = 60


class AcceptAll:
    async def score(self, spec: RewardSpec, items: list[ScoreItem]) -> list[ScoreResult]:
        return [ScoreResult(id=i.id, status=ScoreStatus.SCORE_STATUS_OK, score=1.0) for i in items]


def _context(
    tokenizer_dir: Path, router: Any, on_weight_update: str, group_size: int = 2, function: str = "single_turn"
) -> RolloutContext:
    rollout = {
        "function": function,
        "group_size": group_size,
        "sampling": {"max_new_tokens": MAX_NEW_TOKENS},
        "on_weight_update": on_weight_update,
    }
    spec = resolve(json_format.ParseDict(spec_json(tokenizer_dir, rollout=rollout), RunSpec()))
    registry = RolloutRegistry.from_entry_points()
    environment = spec.rollout.multi_turn.environment
    return RolloutContext(
        router=router,
        reward=AcceptAll(),  # type: ignore[arg-type]
        tokenizer=load_tokenizer(str(tokenizer_dir)),
        spec=spec,
        limit=asyncio.Semaphore(4),
        metrics=RolloutMetrics(),
        rollout=registry.function(function),
        environment=registry.environment(environment) if environment else None,
    )


def test_an_aborted_answer_keeps_its_tokens_and_versions_are_read_oldest_first() -> None:
    meta: dict[str, object] = {
        "finish_reason": {"type": "abort", "message": "Abort in running batch"},
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, 20, None], [-0.25, 21, None]],
    }
    aborted = parse_completion({"text": "ab", "output_ids": [20, 21], "meta_info": meta})
    assert aborted.finish_reason == ABORT and "aborted" in aborted.error
    assert aborted.output_ids == (20, 21) and aborted.logprobs == (-0.5, -0.25) and aborted.weight_versions == (3,)
    spans = [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}]  # SGLang's
    meta = {**meta, "finish_reason": {"type": "length"}, "weight_versions": spans}
    spanning = parse_completion({"text": "ab", "output_ids": [20, 21], "meta_info": meta})
    assert spanning.weight_versions == (2, 3) and spanning.weight_version == 3 and not spanning.error


def test_join_concatenates_tokens_logprobs_text_and_versions() -> None:
    head = Completion((1, 2), (-0.1, -0.2), "ab", ABORT, 4, (4,), cached_tokens=3, error="generation aborted")
    tail = Completion((3,), (-0.3,), "c", LENGTH, 5, (5,), cached_tokens=0)
    whole = join(head, tail, _letters)
    assert whole.output_ids == (1, 2, 3) and whole.logprobs == (-0.1, -0.2, -0.3) and whole.text == "abc"
    assert whole.weight_versions == (4, 5) and whole.weight_version == 5
    assert whole.finish_reason == LENGTH and not whole.error and whole.cached_tokens == 3
    assert join(Completion(finish_reason=ABORT, error="x"), tail, _letters).weight_versions == (5,)


def _letters(ids: list[int]) -> str:
    return "".join("_abc"[i] for i in ids)


PIECES = ["</s>", "\u2581the", "\u2581answer", "\u2581is", "\u258142", "END"]


def _sentencepiece(ids: list[int]) -> str:
    """Decodes as SentencePiece does: "\u2581" is a space, and the one that starts the text is dropped."""
    return "".join(PIECES[i] for i in ids if i).replace("\u2581", " ").removeprefix(" ")


def test_the_continuations_text_is_decoded_after_the_aborted_tokens() -> None:
    """Decoded alone, a SentencePiece continuation loses the space its first token begins with: the reward
    read "the answeris 42"."""
    head = Completion((1, 2), (-0.1,) * 2, "the answer", ABORT, 4, (4,), error="generation aborted")
    tail = Completion((3, 4, 0), (-0.2,) * 3, "is 42", LENGTH, 5, (5,))
    assert join(head, tail, _sentencepiece).text == "the answer is 42"
    # The engine cut a matched stop string from the continuation's end: so does the join.
    stopped = Completion((3, 4, 5), (-0.2,) * 3, "is 42", FinishReason.FINISH_REASON_STOP, 5, (5,))
    assert join(head, stopped, _sentencepiece).text == "the answer is 42"
    # Text that is not this tokenizer's decode of the tokens is the engine's, kept as it came.
    other = Completion((3, 4), (-0.2,) * 2, "IS 42", LENGTH, 5, (5,))
    assert join(head, other, _sentencepiece).text == "the answerIS 42"
    # Halves the engine sent no text for are decoded; an empty text is kept (the tail was only a stop string).
    untold = Completion((1, 2), (-0.1,) * 2, None, ABORT, 4, (4,), error="generation aborted")
    assert join(untold, replace(tail, text=None), _sentencepiece).text == "the answer is 42"
    assert join(head, replace(stopped, output_ids=(5,), logprobs=(-0.2,), text=""), _sentencepiece).text == "the answer"


def test_a_character_the_cut_splits_is_whole_in_the_joined_text() -> None:
    """A byte-level tokenizer spells a character it lacks in 2-4 byte tokens: cut between them, the head's text
    ended in U+FFFD and the tail's began with one, and the reward read '5\ufffd\ufffd per day' for '5€ per day'."""
    euro = list("€".encode())

    def byte_level(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    head_ids, tail_ids = list(b"is 5") + euro[:2], euro[2:] + list(b" a day")
    head = Completion(tuple(head_ids), (-0.1,) * 6, byte_level(head_ids), ABORT, 4, (4,), error="generation aborted")
    tail = Completion(tuple(tail_ids), (-0.2,) * 7, byte_level(tail_ids), LENGTH, 5, (5,))
    assert join(head, tail, byte_level).text == "is 5€ a day"


class AlwaysAborts:
    """A router whose engines abort every request after one token."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        self.calls += 1
        return [Completion((7,), (-1.0,), "x", ABORT, 1, (1,), error="generation aborted") for _ in prompts]


def test_resuming_is_bounded_and_off_unless_the_spec_asks(tokenizer_dir: Path) -> None:
    sampling = [{"max_new_tokens": MAX_NEW_TOKENS}]
    router = AlwaysAborts()
    ctx = _context(tokenizer_dir, router, "abort_resume")
    [result] = asyncio.run(generate_resuming(ctx, [[5]], sampling, ["r"]))
    assert router.calls == 1 + MAX_RESUMES and len(result.output_ids) == 1 + MAX_RESUMES
    assert result.finish_reason == ABORT and result.error
    resumed = ctx.metrics.registry.get_sample_value("rlfleet_rollout_resumed_generations_total")
    assert resumed == MAX_RESUMES
    router = AlwaysAborts()
    asyncio.run(generate_resuming(_context(tokenizer_dir, router, "finish"), [[5]], sampling, ["r"]))
    assert router.calls == 1


def _chars(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


def _decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_a_stop_string_the_cut_splits_ends_the_joined_generation_where_the_engine_would_have() -> None:
    head = Completion(_chars("abc EN"), (-0.1,) * 6, "abc EN", ABORT, 4, (4,), error="generation aborted")
    tail = Completion(_chars("D! more"), (-0.2,) * 7, "D! more", LENGTH, 5, (5,))
    cut = stop_across_the_cut(join(head, tail, _decode), head, ["END"], _decode)
    assert cut.output_ids == _chars("abc END") and cut.logprobs == (-0.1,) * 6 + (-0.2,)
    assert cut.text == "abc " and cut.finish_reason == FinishReason.FINISH_REASON_STOP and not cut.error
    assert cut.weight_versions == (4, 5)
    # A stop string wholly in one half was the engine's to match; none at all leaves the join as it is.
    for stops in (["more"], ["abc"], ["zz"], []):
        assert stop_across_the_cut(join(head, tail, _decode), head, stops, _decode) == join(head, tail, _decode)


def test_a_stop_string_the_cut_splits_is_found_when_the_continuation_ended_on_its_own() -> None:
    """The continuation "\n\n" matched the stop on its own and came back trimmed to "": the search read the
    trimmed text, missed the "\n\n" across the cut, and the sample kept a token and read "42\n"."""
    head = Completion(_chars("42\n"), (-0.1,) * 3, "42\n", ABORT, 4, (4,), error="generation aborted")
    tail = Completion(_chars("\n\n"), (-0.2,) * 2, "", FinishReason.FINISH_REASON_STOP, 5, (5,))
    cut = stop_across_the_cut(join(head, tail, _decode), head, ["\n\n"], _decode)
    assert (cut.text, cut.output_ids, cut.finish_reason) == ("42", _chars("42\n\n"), FinishReason.FINISH_REASON_STOP)


def test_of_two_stop_strings_the_cut_splits_the_one_completed_first_ends_the_generation() -> None:
    """An engine stops at the token completing any stop string; the stop beginning first ("abcd") was taken,
    which kept "d", a token the engine never generated, in the sample with loss mask 1."""
    head = Completion(_chars("x ab"), (-0.1,) * 4, "x ab", ABORT, 4, (4,), error="generation aborted")
    tail = Completion(_chars("cd y"), (-0.2,) * 4, "cd y", LENGTH, 5, (5,))
    for stops in (["abcd", "bc"], ["bc", "abcd"]):
        cut = stop_across_the_cut(join(head, tail, _decode), head, stops, _decode)
        assert (cut.output_ids, cut.text) == (_chars("x abc"), "x a")
    # Two completed by the same token: the one listed first, as the engine checks them.
    for stops, text in ((["abc", "bc"], "x "), (["bc", "abc"], "x a")):
        cut = stop_across_the_cut(join(head, tail, _decode), head, stops, _decode)
        assert (cut.output_ids, cut.text) == (_chars("x abc"), text)


class AbortsThenFinishesTheStop:
    """Aborts a generation after "x [EN"; its continuation is "D] y"."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        self.calls += 1
        text = "x [EN" if self.calls == 1 else "D] y"
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
        reason, error = (ABORT, "generation aborted") if self.calls == 1 else (LENGTH, "")
        return [Completion(ids, (-1.0,) * len(ids), text, reason, self.calls, (self.calls,), error=error)]


def test_resuming_matches_a_stop_string_across_the_cut(tokenizer_dir: Path) -> None:
    router = AbortsThenFinishesTheStop(load_tokenizer(str(tokenizer_dir)))
    ctx = _context(tokenizer_dir, router, "abort_resume")
    [whole] = asyncio.run(generate_resuming(ctx, [[5]], [{"max_new_tokens": 20, "stop": ["END]"]}], ["r"]))
    assert router.calls == 2 and whole.text == "x [" and whole.finish_reason == FinishReason.FINISH_REASON_STOP
    assert whole.output_ids == tuple(ctx.tokenizer.encode("x [END]", add_special_tokens=False).ids)


# -- across a real weight update -----------------------------------------------------------------


@pytest.fixture
def sim_router(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(router url, engine url): one `sim` engine at weight version 0 (50 ms per decode step), one router."""
    engine_port, router_port = free_port(), free_port()
    engine_argv = [sys.executable, "-m", "rlfleet_engine", "--backend", "sim", "--model-path", "sim"]
    engine_argv += ["--port", str(engine_port), "--weight-version", "0", "--sim-decode-ms-per-step", "50"]
    engine_argv += ["--log-level", "warning"]
    router_argv = [sys.executable, "-m", "rlfleet_router", "--port", str(router_port), "--policy", "least_load"]
    router_argv += ["--health-check-endpoint", "/health", "--health-check-interval-secs", "0.5"]
    router_argv += ["--log-level", "warning", "--worker-urls", f"http://127.0.0.1:{engine_port}"]
    engine = ServiceProcess("sim-engine", engine_argv, tmp_path / "engine.log")
    router = None
    try:
        engine.wait_healthy(f"http://127.0.0.1:{engine_port}/health", timeout=30)
        router = ServiceProcess("router", router_argv, tmp_path / "router.log")
        router.wait_healthy(f"http://127.0.0.1:{router_port}/health", timeout=30)
        yield f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{engine_port}"
    finally:
        if router is not None:
            router.stop(timeout=10)
        engine.stop(timeout=10)


class RecordingRouter(RouterClient):
    """The real client, keeping every /generate batch it sent and what came back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[list[int]], list[dict[str, Any]], tuple[Completion, ...]]] = []

    async def generate(self, prompts: list[list[int]], sampling: Any, rids: list[str]) -> list[Completion]:
        completions = await super().generate(prompts, sampling, rids)
        self.calls.append((prompts, sampling, tuple(completions)))
        return completions


async def _running(client: httpx.AsyncClient, engine_url: str, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await client.get(f"{engine_url}/get_server_info")).json()
        if info["internal_states"][0]["num_running_reqs"] >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} requests were running on {engine_url} within {timeout}s")


def _group_across_an_update(
    tokenizer_dir: Path, router_url: str, engine_url: str, on_weight_update: str, function: str = "single_turn"
) -> tuple[RecordingRouter, SampleGroup]:
    """A group of 2 samples, with the fleet moved from version 0 to 1 while it generates."""

    async def scenario() -> tuple[RecordingRouter, SampleGroup]:
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
            router = RecordingRouter(client, router_url, timeout_s=30.0)
            ctx = replace(_context(tokenizer_dir, router, on_weight_update, function=function), replies=replies)
            request = GroupRequest("run-p", "run-p/0/p0", 0, Prompt(prompt="3+4=", answer="7"), fallback_version=0)
            group = asyncio.create_task(ctx.rollout(ctx, request))
            await _running(client, engine_url, 2)
            await asyncio.sleep(0.2)  # a few tokens on version 0
            abort = on_weight_update == "abort_resume"
            update = {"model_path": "sim", "weight_version": "1", "abort_all_requests": abort}
            answer = await client.post(f"{router_url}/update_weights_from_disk", json=update)
            assert answer.status_code == 200, answer.text
            return router, await asyncio.wait_for(group, timeout=30)

    replies = ReplyPool(threads=2, timeout_s=30.0)
    try:
        return asyncio.run(scenario())
    finally:
        replies.close()


@pytest.mark.e2e
def test_a_generation_aborted_by_a_weight_update_is_resumed_on_the_new_version(
    tokenizer_dir: Path, sim_router: tuple[str, str]
) -> None:
    router, group = _group_across_an_update(tokenizer_dir, *sim_router, "abort_resume")
    assert len(router.calls) == 2, "one batch on version 0, one resuming it on version 1"
    (prompts, sampling, partial), (resumed_prompts, resumed_sampling, continuation) = router.calls
    for j, sample in enumerate(group.samples):
        head, tail = partial[j], continuation[j]
        assert head.finish_reason == ABORT and head.weight_versions == (0,)
        assert 0 < len(head.output_ids) < MAX_NEW_TOKENS
        assert resumed_prompts[j] == prompts[j] + list(head.output_ids)
        assert resumed_sampling[j]["max_new_tokens"] == MAX_NEW_TOKENS - len(head.output_ids)
        assert resumed_sampling[j]["sampling_seed"] == continued_seed(
            sampling[j]["sampling_seed"], len(head.output_ids)
        )
        assert tail.weight_versions == (1,) and tail.finish_reason == LENGTH
        assert list(sample.response_token_ids) == list(head.output_ids + tail.output_ids)
        assert list(sample.rollout_logprobs) == pytest.approx(head.logprobs + tail.logprobs)
        assert len(sample.response_token_ids) == MAX_NEW_TOKENS == len(sample.loss_mask)
        assert list(sample.weight_versions) == [0, 1]
        assert sample.status == SampleStatus.SAMPLE_STATUS_TRUNCATED


@pytest.mark.e2e
def test_under_finish_a_generation_runs_through_the_update_and_names_both_versions(
    tokenizer_dir: Path, sim_router: tuple[str, str]
) -> None:
    router, group = _group_across_an_update(tokenizer_dir, *sim_router, "finish")
    assert len(router.calls) == 1
    for sample in group.samples:
        assert len(sample.response_token_ids) == MAX_NEW_TOKENS
        assert list(sample.weight_versions) == [0, 1]
        assert sample.status == SampleStatus.SAMPLE_STATUS_TRUNCATED


@pytest.mark.e2e
def test_a_multi_turn_turn_aborted_by_a_weight_update_is_resumed_in_its_trajectory(
    tokenizer_dir: Path, sim_router: tuple[str, str]
) -> None:
    # The sim engine's letters never call the calculator: each episode is one turn, cut by the update.
    _, group = _group_across_an_update(tokenizer_dir, *sim_router, "abort_resume", function="multi_turn")
    for sample in group.samples:
        # multi_turn checks the episode against the router's trajectory: a mismatch would fail the sample.
        assert sample.status == SampleStatus.SAMPLE_STATUS_TRUNCATED, sample.error
        assert len(sample.response_token_ids) == MAX_NEW_TOKENS == len(sample.loss_mask) == sum(sample.loss_mask)
        assert list(sample.weight_versions) == [0, 1] and sample.metadata["turns"] == "1"
