"""The multi_turn rollout function and the calculator environment, in process: a fake router that keeps
trajectories the way the real one lays them out, a fake reward hub that scores the last turn."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from rollout_test_support import EOS_ID, spec_json
from tokenizers import Tokenizer

from rlfleet.char_tokenizer import vocabulary
from rlfleet.errors import Unavailable
from rlfleet.run_spec import resolve
from rlfleet.v1.reward_pb2 import RewardSpec, ScoreItem, ScoreResult, ScoreStatus
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import FinishReason, Sample, SampleGroup, SampleStatus
from rlfleet_rollout.calculator import calculator, evaluate
from rlfleet_rollout.concurrency import gather_cancelling
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.environment import ReplyPool
from rlfleet_rollout.evaluation import evaluate as evaluate_run
from rlfleet_rollout.group_producer import GroupRequest, RolloutContext
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.multi_turn import multi_turn
from rlfleet_rollout.partial_rollout import continued_seed
from rlfleet_rollout.prompt_tokenizer import load_tokenizer
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.router_client import Completion, Trajectory

VOCAB = vocabulary()
CHARS = {i: c for c, i in VOCAB.items()}


def _ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


@pytest.fixture(scope="module")
def replies() -> Iterator[ReplyPool]:
    pool = ReplyPool(threads=4, timeout_s=10.0)
    yield pool
    pool.close()


@pytest.mark.parametrize(
    ("expression", "value"),
    [("37+45", 82), ("2*(3-5)/4", Fraction(-1, 1)), ("-3--2", -1), (" 7 * 6 ", 42), ("1/3", Fraction(1, 3))],
)
def test_the_calculator_parses_arithmetic(expression: str, value: Fraction) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["1/0", "2+", "(1", "1)", "a+1", "__import__('os')", "", "\u0661+\u0662"])
def test_the_calculator_rejects_what_is_not_arithmetic(expression: str) -> None:
    with pytest.raises(ValueError):
        evaluate(expression)


def test_the_calculator_answers_a_bracketed_call_and_ends_on_an_answer() -> None:
    prompt = Prompt(prompt="12+7=", answer="19")
    assert calculator.reply(prompt, ["[12+7]"]) == "=19\n"
    assert calculator.reply(prompt, ["[1/4]"]) == "=0.25\n"
    assert calculator.reply(prompt, ["[12+x]"]) == "=error\n"
    assert calculator.reply(prompt, ["19"]) is None


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("1234567/2", "617283.5"),  # was 617284: a rounded value that read as exact
        ("2469135/2", "1234567.5"),  # was 1.23457e+06
        ("1/3000000", "0.000000333333"),  # was 3.33333e-07
        ("-2/3", "-0.666667"),
        ("(10000000000+1)/10000000000", "1.0"),  # rounded, but still not whole
    ],
)
def test_the_calculator_shows_a_decimal_never_an_exponent_nor_a_rounded_whole(expression: str, shown: str) -> None:
    assert calculator.reply(Prompt(prompt="", answer=""), [f"[{expression}]"]) == f"={shown}\n"


def test_a_call_past_the_expression_bound_is_an_error_not_an_answer() -> None:
    """A bracketed call of 65 characters matched no call: the turn was taken for the final answer."""
    assert calculator.reply(Prompt(prompt="", answer=""), ["[" + "1+" * 32 + "1]"]) == "=error\n"


class FakeRouter:
    """Answers `[a+b]<eos>` to a prompt ending in `=` and the tool's number `<eos>` after a tool reply."""

    def __init__(self, fail_turn: int | None = None) -> None:
        self.turns: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}
        self.fail_turn = fail_turn
        self.forgotten: list[str] = []

    async def generate_turn(self, prompt: list[int], sampling: dict[str, Any], rid: str, tid: str) -> Completion:
        turns = self.turns.setdefault(tid, [])
        if len(turns) == self.fail_turn:
            raise Unavailable("no healthy engine")
        text = "".join(CHARS[i] for i in prompt)
        said = f"[{text.rstrip('=')}]" if text.endswith("=") else text.rstrip("\n").rsplit("=", 1)[-1]
        output = _ids(said)[: sampling["max_new_tokens"] - 1] + [EOS_ID]
        logprobs = [-0.5 - 0.01 * k for k in range(len(output))]
        turns.append((list(prompt), output, logprobs))
        return Completion(
            output_ids=tuple(output),
            logprobs=tuple(logprobs),
            text=said,
            finish_reason=FinishReason.FINISH_REASON_STOP,
            weight_version=3,
        )

    async def trajectory(self, tid: str) -> Trajectory:
        (prompt, output, logprobs), *rest = self.turns[tid]
        response, lps, mask = list(output), list(logprobs), [1] * len(output)
        for turn_prompt, turn_output, turn_logprobs in rest:
            between = turn_prompt[len(prompt) + len(response) :]
            response += between + turn_output
            lps += [0.0] * len(between) + turn_logprobs
            mask += [0] * len(between) + [1] * len(turn_output)
        return Trajectory(tuple(prompt), tuple(response), tuple(lps), tuple(mask), (3,))

    async def forget_trajectory(self, tid: str) -> None:
        self.forgotten.append(tid)


class FakeHub:
    async def score(self, spec: RewardSpec, items: list[ScoreItem]) -> list[ScoreResult]:
        return [
            ScoreResult(id=i.id, status=ScoreStatus.SCORE_STATUS_OK, score=float(i.response == i.label)) for i in items
        ]


class AbortsFirstTurns(FakeRouter):
    """Aborts each trajectory's first turn after 3 tokens, as a weight update would, recording the partial
    turn as the router does; the resumed call (prompt + partial) gets the rest of what was coming."""

    def __init__(self) -> None:
        super().__init__()
        self.rest: dict[str, tuple[list[int], list[float]]] = {}
        self.resumed: list[tuple[list[int], dict[str, Any], str]] = []
        self.seeds: dict[str, int] = {}  # of each trajectory's first call

    async def generate_turn(self, prompt: list[int], sampling: dict[str, Any], rid: str, tid: str) -> Completion:
        if tid in self.rest:
            self.resumed.append((list(prompt), dict(sampling), rid))
            output, logprobs = self.rest.pop(tid)
            self.turns[tid].append((list(prompt), output, logprobs))
            text = "".join(CHARS.get(i, "") for i in output)
            return Completion(tuple(output), tuple(logprobs), text, FinishReason.FINISH_REASON_STOP, 4, (4,))
        whole = await super().generate_turn(prompt, sampling, rid, tid)
        if len(self.turns[tid]) > 1:
            return whole
        self.seeds[tid] = sampling["sampling_seed"]
        head, logprobs = list(whole.output_ids[:3]), list(whole.logprobs[:3])
        self.turns[tid][0] = (list(prompt), head, logprobs)
        self.rest[tid] = (list(whole.output_ids[3:]), list(whole.logprobs[3:]))
        abort = FinishReason.FINISH_REASON_ABORT
        return Completion(tuple(head), tuple(logprobs), whole.text[:3], abort, 3, (3,), error="generation aborted")


def _context(
    tokenizer_dir: Path, replies: ReplyPool, router: FakeRouter, max_turns: int, on_weight_update: str = "finish"
) -> RolloutContext:
    rollout = {
        "function": "multi_turn",
        "multi_turn": {"max_turns": max_turns},
        "group_size": 2,
        "sampling": {"max_new_tokens": 8},
        "on_weight_update": on_weight_update,
    }
    spec = resolve(json_format.ParseDict(spec_json(tokenizer_dir, rollout=rollout), RunSpec()))
    registry = RolloutRegistry.from_entry_points()
    registry.check(spec.rollout)
    tokenizer: Tokenizer = load_tokenizer(str(tokenizer_dir))
    return RolloutContext(
        router=router,  # type: ignore[arg-type]
        reward=FakeHub(),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        spec=spec,
        limit=asyncio.Semaphore(4),
        metrics=RolloutMetrics(),
        rollout=registry.function(spec.rollout.function),
        environment=registry.environment(spec.rollout.multi_turn.environment),
        replies=replies,
    )


def _request() -> GroupRequest:
    return GroupRequest("run-1", "run-1/0/p5", 5, Prompt(prompt="12+7=", answer="19"), fallback_version=0)


def test_an_episode_masks_the_tool_reply_and_scores_the_last_turn(tokenizer_dir: Path, replies: ReplyPool) -> None:
    router = FakeRouter()
    ctx = _context(tokenizer_dir, replies, router, max_turns=3)
    group = asyncio.run(multi_turn(ctx, _request()))
    assert [s.status for s in group.samples] == [SampleStatus.SAMPLE_STATUS_OK] * 2
    sample = group.samples[0]
    call, reply, answer = _ids("[12+7]") + [EOS_ID], _ids("=19\n"), _ids("19") + [EOS_ID]
    assert list(sample.prompt_token_ids) == _ids("12+7=")
    assert list(sample.response_token_ids) == call + reply + answer
    assert list(sample.loss_mask) == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
    assert list(sample.rollout_logprobs[len(call) : len(call) + len(reply)]) == [0.0] * len(reply)
    assert sample.reward == 1.0 and sample.metadata["turns"] == "2" and list(sample.weight_versions) == [3]
    assert sample.metadata["trajectory_id"] in router.turns and "/" not in sample.metadata["trajectory_id"]
    assert group.samples[0].seed != group.samples[1].seed
    exported = ctx.metrics.registry.get_sample_value("rlfleet_rollout_episode_turns_count")
    assert exported == 2 and ctx.metrics.registry.get_sample_value("rlfleet_rollout_episode_turns_sum") == 4


def test_a_turn_aborted_by_a_weight_update_is_resumed_within_its_trajectory(
    tokenizer_dir: Path, replies: ReplyPool
) -> None:
    router = AbortsFirstTurns()
    ctx = _context(tokenizer_dir, replies, router, max_turns=3, on_weight_update="abort_resume")
    group = asyncio.run(multi_turn(ctx, _request()))
    assert [s.status for s in group.samples] == [SampleStatus.SAMPLE_STATUS_OK] * 2
    call, reply, answer = _ids("[12+7]") + [EOS_ID], _ids("=19\n"), _ids("19") + [EOS_ID]
    for sample in group.samples:
        assert list(sample.response_token_ids) == call + reply + answer
        assert list(sample.loss_mask) == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
        assert sample.reward == 1.0 and sample.metadata["turns"] == "2"
    for prompt, sampling, rid in router.resumed:
        assert prompt == _ids("12+7=") + call[:3] and sampling["max_new_tokens"] == 8 - 3
        assert rid.endswith("/0+resume1")
        # A seed of its own: under the turn's, rlfleet-engine drew the same random numbers again from its start.
        first = router.seeds[rid.removesuffix("/0+resume1")]
        assert sampling["sampling_seed"] == continued_seed(first, 3) != first
    assert len(router.resumed) == 2
    assert ctx.metrics.registry.get_sample_value("rlfleet_rollout_resumed_generations_total") == 2


def test_without_abort_resume_an_aborted_turn_fails_only_its_sample(tokenizer_dir: Path, replies: ReplyPool) -> None:
    group = asyncio.run(multi_turn(_context(tokenizer_dir, replies, AbortsFirstTurns(), max_turns=3), _request()))
    assert [s.status for s in group.samples] == [SampleStatus.SAMPLE_STATUS_ABORTED] * 2


def test_the_turn_bound_ends_an_episode_without_a_reply(tokenizer_dir: Path, replies: ReplyPool) -> None:
    group = asyncio.run(multi_turn(_context(tokenizer_dir, replies, FakeRouter(), max_turns=1), _request()))
    sample = group.samples[0]
    assert list(sample.loss_mask) == [1] * len(sample.response_token_ids)
    assert sample.reward == 0.0 and sample.metadata["turns"] == "1"


def test_a_failed_turn_fails_its_sample_not_the_group(tokenizer_dir: Path, replies: ReplyPool) -> None:
    group = asyncio.run(multi_turn(_context(tokenizer_dir, replies, FakeRouter(fail_turn=1), max_turns=3), _request()))
    assert [s.status for s in group.samples] == [SampleStatus.SAMPLE_STATUS_FAILED] * 2
    assert "turn 2: generation failed" in group.samples[0].error


class TrimsTheStop(FakeRouter):
    """Ends a turn at a stop string as SGLang does: its tokens up to the one that completes the stop string, its text
    without the stop string."""

    async def generate_turn(self, prompt: list[int], sampling: dict[str, Any], rid: str, tid: str) -> Completion:
        whole = await super().generate_turn(prompt, sampling, rid, tid)
        said = whole.text or ""
        at = min((said.find(s) for s in sampling.get("stop", ()) if s in said), default=-1)
        if at < 0:
            return whole
        end = at + len(next(s for s in sampling["stop"] if said.find(s) == at))
        turn = self.turns[tid][-1]
        self.turns[tid][-1] = (turn[0], turn[1][:end], turn[2][:end])
        return replace(whole, output_ids=whole.output_ids[:end], logprobs=whole.logprobs[:end], text=said[:at])


def test_the_environment_reads_a_turn_with_the_stop_string_that_ended_it(
    tokenizer_dir: Path, replies: ReplyPool
) -> None:
    """The engine cuts a matched stop string from its text, not from the turn's tokens: given that text, the
    calculator read `[12+7` (its call closed by the stop string "]") as the final answer, and every episode ended
    there, wrong, without calling it."""
    ctx = _context(tokenizer_dir, replies, TrimsTheStop(), max_turns=3)
    ctx.spec.rollout.sampling.stop.append("]")
    group = asyncio.run(multi_turn(ctx, _request()))
    call, reply, answer = _ids("[12+7]"), _ids("=19\n"), _ids("19") + [EOS_ID]
    for sample in group.samples:
        assert sample.status == SampleStatus.SAMPLE_STATUS_OK and sample.metadata["turns"] == "2", sample.error
        assert list(sample.response_token_ids) == call + reply + answer
        assert list(sample.loss_mask) == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
        assert sample.reward == 1.0


class ForgetsBetweenTurns(FakeRouter):
    """Drops each trajectory before its second turn, as the router evicts one (two weight updates while a tool
    ran, its token budget) or restarts: the second turn starts a new trajectory on the whole conversation."""

    async def generate_turn(self, prompt: list[int], sampling: dict[str, Any], rid: str, tid: str) -> Completion:
        if len(self.turns.get(tid, [])) == 1:
            del self.turns[tid]
        return await super().generate_turn(prompt, sampling, rid, tid)


def test_a_trajectory_that_lost_its_earlier_turns_fails_its_sample(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """Its tokens line up with the episode's end to end, but paired with the episode's prompt it would train
    the last turn's answer as the answer to the first prompt."""
    group = asyncio.run(multi_turn(_context(tokenizer_dir, replies, ForgetsBetweenTurns(), max_turns=3), _request()))
    assert [s.status for s in group.samples] == [SampleStatus.SAMPLE_STATUS_FAILED] * 2
    assert "does not start at the episode's prompt" in group.samples[0].error
    assert group.samples[0].metadata["turns"] == "2", "the turns that ran, though the trajectory failed"


def test_an_episode_ends_cut_where_the_models_context_does(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """Sending every turn the full max_new_tokens past the context got a 400 from the engine and failed the
    whole episode; each turn is now cut to the room left, and an episode with no room for another turn ends
    as a truncated one (rollout.truncated applies)."""
    prompt, call, reply = _ids("12+7="), _ids("[12+7]") + [EOS_ID], _ids("=19\n")

    def run(context_tokens: int) -> Sample:
        ctx = replace(_context(tokenizer_dir, replies, FakeRouter(), max_turns=3), context_tokens=context_tokens)
        return asyncio.run(multi_turn(ctx, _request())).samples[0]

    # SGLang refuses a prompt and max_new_tokens that together reach the context: a turn needs the prompt + 2.
    full = run(len(prompt) + len(call) + len(reply) + 1)  # the reply leaves no room for turn 2
    assert full.status == SampleStatus.SAMPLE_STATUS_TRUNCATED and full.metadata["turns"] == "1"
    assert list(full.response_token_ids) == call
    assert run(len(prompt) + len(call) + len(reply) + 2).metadata["turns"] == "2"
    cut = run(len(prompt) + 5)  # the first turn itself is cut to 4 tokens
    assert len(cut.response_token_ids) == 4 and cut.status == SampleStatus.SAMPLE_STATUS_TRUNCATED
    assert run(len(prompt) + 64).metadata["turns"] == "2"  # room enough: as without a bound
    failed = run(len(prompt) + 1)  # the prompt fills the context but one token: no sample, a named reason
    assert failed.status == SampleStatus.SAMPLE_STATUS_FAILED and "leaves no room" in failed.error


class CountsEpisodesUnderWay(FakeRouter):
    """Counts trajectories begun and not yet forgotten, the most at once; each turn takes a moment."""

    def __init__(self) -> None:
        super().__init__()
        self.under_way: set[str] = set()
        self.most = 0

    async def generate_turn(self, prompt: list[int], sampling: dict[str, Any], rid: str, tid: str) -> Completion:
        self.under_way.add(tid)
        self.most = max(self.most, len(self.under_way))
        await asyncio.sleep(0.01)
        return await super().generate_turn(prompt, sampling, rid, tid)

    async def forget_trajectory(self, tid: str) -> None:
        self.under_way.discard(tid)
        await super().forget_trajectory(tid)


def test_an_evaluation_has_at_most_a_batch_of_episodes_under_way(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """Every episode of an evaluation started at once: their first turns all ran before any second one, and
    together their trajectories passed the router's cache budget, which evicted the episodes still under way
    (1000 held-out prompts lost a third of their samples)."""
    router = CountsEpisodesUnderWay()
    ctx = _context(tokenizer_dir, replies, router, max_turns=3)
    prompts = [Prompt(prompt=f"{a}+1=", answer=str(a + 1)) for a in range(24)]
    result = asyncio.run(evaluate_run(ctx, "run-1", 0, prompts, batch_size=4, trainer_version=0))
    assert result.accuracy == 1.0 and len(router.forgotten) == 24
    assert router.most == 4


def test_training_has_at_most_its_bound_of_episodes_under_way(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """As evaluation's: a step's groups all started at once ran every episode's first turn before any second one,
    and the router evicted the episodes waiting for their next turn (16 groups of 8 over a 20k-token budget lost
    65 of 128 samples)."""
    router = CountsEpisodesUnderWay()
    ctx = replace(_context(tokenizer_dir, replies, router, max_turns=3), episodes=asyncio.Semaphore(3))

    async def step() -> list[SampleGroup]:
        requests = [
            GroupRequest("run-1", f"run-1/0/p{i}", i, Prompt(prompt=f"{i}+1=", answer=str(i + 1)), fallback_version=0)
            for i in range(6)
        ]
        return await asyncio.gather(*(multi_turn(ctx, r) for r in requests))

    groups = asyncio.run(step())
    assert [s.status for g in groups for s in g.samples] == [SampleStatus.SAMPLE_STATUS_OK] * 12
    assert router.most == 3, router.most


def test_a_multi_turn_run_is_evaluated_in_episodes(tokenizer_dir: Path, replies: ReplyPool) -> None:
    router = FakeRouter()
    ctx = _context(tokenizer_dir, replies, router, max_turns=3)
    prompts = [Prompt(prompt="12+7=", answer="19"), Prompt(prompt="30+4=", answer="34")]
    result = asyncio.run(evaluate_run(ctx, "run-1", 0, prompts, batch_size=8, trainer_version=0))
    assert result.accuracy == 1.0 and result.pass_at_k == 1.0  # only the turn after the tool's reply is right
    assert result.mean_length == (len("[12+7]=19\n19") + 2 + len("[30+4]=34\n34") + 2) / 2
    assert all(len(turns) == 2 for turns in router.turns.values()) and len(router.turns) == 2


def test_a_multi_turn_evaluation_leaves_out_a_prompt_over_max_prompt_tokens(
    tokenizer_dir: Path, replies: ReplyPool
) -> None:
    """As training skips it: no episode of it starts, and it is counted, not scored."""
    router = FakeRouter()
    ctx = _context(tokenizer_dir, replies, router, max_turns=3)
    ctx.spec.rollout.max_prompt_tokens = 10
    prompts = [
        Prompt(prompt="12+7=", answer="19"),
        Prompt(prompt="1+1+1+1+1+1+1+1=", answer="8"),
        Prompt(prompt="30+4=", answer="34"),
    ]
    result = asyncio.run(evaluate_run(ctx, "run-1", 0, prompts, batch_size=8, trainer_version=0))
    assert (result.size, result.prompts_too_long, result.failed, result.accuracy) == (2, 1, 0, 1.0)
    assert len(router.turns) == 2 and not any(":eval:0:1:" in tid for tid in router.turns)


def test_an_environment_without_a_reply_method_is_refused_at_start_up() -> None:
    with pytest.raises(TypeError, match="'broken' is a object without a reply"):
        RolloutRegistry({}, {"broken": object()})


def test_an_environment_registered_as_its_class_is_refused_at_start_up() -> None:
    """The class passed the protocol check (it has a reply attribute), then every episode failed: `reply()
    missing 1 required positional argument: 'turns'`."""
    with pytest.raises(TypeError, match=r"'calc' is the class CalculatorEnvironment, not an instance of it"):
        RolloutRegistry({}, {"calc": type(calculator)})


class LosesItsSession:
    """The calculator, except that its first reply raises, as a tool backend that lost its session would."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0

    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        with self.lock:  # replies run in worker threads
            self.calls += 1
            if self.calls == 1:
                raise KeyError("tool backend lost its session")
        return calculator.reply(prompt, turns)


class Exits:
    """A tool that ends as a command line tool does on bad input (argparse calls sys.exit(2)), or with another
    BaseException: an interrupt, or a CancelledError from its own event loop."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        raise self.error


@pytest.mark.parametrize("error", [SystemExit(2), KeyboardInterrupt(), asyncio.CancelledError()])
def test_an_environment_that_exits_fails_its_sample_not_the_orchestrator(
    tokenizer_dir: Path, replies: ReplyPool, error: BaseException
) -> None:
    """Before, the exception went up unchanged: SystemExit ended the orchestrator's event loop, and a
    CancelledError looked like the group's own cancellation."""
    ctx = replace(_context(tokenizer_dir, replies, FakeRouter(), max_turns=3), environment=Exits(error))
    group = asyncio.run(multi_turn(ctx, _request()))
    assert [s.status for s in group.samples] == [SampleStatus.SAMPLE_STATUS_FAILED] * 2
    name = type(error).__name__
    assert group.samples[0].error == f"turn 1: environment failed: RuntimeError: raised {name}{error.args!r}"


def test_an_episode_deletes_its_trajectory_at_the_router_once_read(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """Before, finished episodes stayed in the router's cache until evicted, and the least recently used went
    first: an episode under way behind a slow tool could be evicted before them, and fail."""
    router = FakeRouter()
    group = asyncio.run(multi_turn(_context(tokenizer_dir, replies, router, max_turns=3), _request()))
    assert sorted(router.forgotten) == sorted(s.metadata["trajectory_id"] for s in group.samples)


def test_an_environment_that_raises_fails_its_sample_not_the_run(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """The exception went up through the group to the run loop, which failed the run."""
    ctx = replace(_context(tokenizer_dir, replies, FakeRouter(), max_turns=3), environment=LosesItsSession())
    group = asyncio.run(multi_turn(ctx, _request()))
    failed, ok = sorted(group.samples, key=lambda s: s.status != SampleStatus.SAMPLE_STATUS_FAILED)
    assert failed.status == SampleStatus.SAMPLE_STATUS_FAILED and ok.status == SampleStatus.SAMPLE_STATUS_OK
    assert failed.error == "turn 1: environment failed: KeyError: 'tool backend lost its session'"
    assert ok.reward == 1.0 and ok.metadata["turns"] == "2"


def test_a_failed_episode_deletes_its_trajectory_at_the_router_too(tokenizer_dir: Path, replies: ReplyPool) -> None:
    """An episode that ended early (its environment raised, a turn failed) left its trajectory in the router's
    cache until evicted, crowding out the episodes under way as a finished one did before it was deleted."""
    router = FakeRouter()
    ctx = replace(_context(tokenizer_dir, replies, router, max_turns=3), environment=LosesItsSession())
    group = asyncio.run(multi_turn(ctx, _request()))
    assert any(s.status == SampleStatus.SAMPLE_STATUS_FAILED for s in group.samples)
    assert sorted(router.forgotten) == sorted(s.metadata["trajectory_id"] for s in group.samples)


class HangsOnSecondTurns(FakeRouter):
    """Every episode's second turn hangs (an engine stuck in a long decode); a DELETE takes a moment."""

    async def generate_turn(self, prompt: list[int], sampling: dict[str, Any], rid: str, tid: str) -> Completion:
        if self.turns.get(tid):
            await asyncio.sleep(30)
        return await super().generate_turn(prompt, sampling, rid, tid)

    async def forget_trajectory(self, tid: str) -> None:
        await asyncio.sleep(0.05)
        await super().forget_trajectory(tid)


def test_episodes_cut_short_by_a_failure_in_their_wave_delete_their_trajectories_before_it_is_raised(
    tokenizer_dir: Path, replies: ReplyPool
) -> None:
    """A group of a step's wave failing cancelled the others' episodes, which were neither awaited nor deleted their
    trajectories when cancelled: each stayed in the router's cache, crowding out the episodes of the steps after."""
    router = HangsOnSecondTurns()
    ctx = _context(tokenizer_dir, replies, router, max_turns=3)

    async def fails_when_the_episodes_are_under_way() -> None:
        while len(router.turns) < 2:
            await asyncio.sleep(0.01)
        raise Unavailable("reward hub: scoring failed")

    async def wave() -> list[str]:
        with pytest.raises(Unavailable, match="scoring failed"):
            await gather_cancelling([multi_turn(ctx, _request()), fails_when_the_episodes_are_under_way()])
        return sorted(router.forgotten)

    assert asyncio.run(wave()) == sorted(router.turns)


class WaitsForTheLoop:
    """A slow tool: its reply waits until a coroutine of the event loop has seen it start, which a reply that
    runs on the loop itself would wait for in vain."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()

    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        self.started.set()
        if not self.go.wait(timeout=5):
            raise TimeoutError("the event loop did not run while the tool worked")
        return calculator.reply(prompt, turns)


def test_a_slow_environment_does_not_block_the_event_loop(tokenizer_dir: Path, replies: ReplyPool) -> None:
    env = WaitsForTheLoop()
    ctx = replace(_context(tokenizer_dir, replies, FakeRouter(), max_turns=3), environment=env)

    async def release_the_tool() -> None:
        async with asyncio.timeout(10):
            while not env.started.is_set():
                await asyncio.sleep(0.01)
        env.go.set()

    async def main() -> list[Sample]:
        releasing = asyncio.create_task(release_the_tool())
        group = await multi_turn(ctx, _request())
        await releasing
        return list(group.samples)

    samples = asyncio.run(main())
    assert [s.status for s in samples] == [SampleStatus.SAMPLE_STATUS_OK] * 2, [s.error for s in samples]


def test_an_episode_waiting_for_its_environment_can_be_cancelled(tokenizer_dir: Path, replies: ReplyPool) -> None:
    env = WaitsForTheLoop()
    ctx = replace(_context(tokenizer_dir, replies, FakeRouter(), max_turns=3), environment=env)

    async def main() -> None:
        producing = asyncio.create_task(multi_turn(ctx, _request()))
        async with asyncio.timeout(10):
            while not env.started.is_set():
                await asyncio.sleep(0.01)
        producing.cancel()
        try:
            async with asyncio.timeout(2):
                with pytest.raises(asyncio.CancelledError):
                    await producing
        finally:
            env.go.set()  # its reply's thread ends too

    asyncio.run(main())


class StopsAnswering:
    """The calculator, except that its first `hanging` replies wait until `release` is set (its tool's backend
    stopped answering)."""

    def __init__(self, hanging: int) -> None:
        self.hanging = hanging
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls = 0

    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        with self.lock:
            self.calls += 1
            hangs = self.calls <= self.hanging
        if hangs:
            self.release.wait(timeout=30)
        return calculator.reply(prompt, turns)


def test_an_environment_that_does_not_reply_in_time_fails_its_sample_not_the_group(tokenizer_dir: Path) -> None:
    """A reply was not bounded: a hung tool held its group, and with it the step, forever."""
    env, pool = StopsAnswering(hanging=1), ReplyPool(threads=2, timeout_s=0.3)
    ctx = replace(_context(tokenizer_dir, pool, FakeRouter(), max_turns=3), environment=env)
    try:
        group = asyncio.run(multi_turn(ctx, _request()))
    finally:
        env.release.set()
        pool.close()
    failed, ok = sorted(group.samples, key=lambda s: s.status != SampleStatus.SAMPLE_STATUS_FAILED)
    assert failed.status == SampleStatus.SAMPLE_STATUS_FAILED and failed.error == (
        "turn 1: environment did not reply within 0.3s"
    )
    assert ok.status == SampleStatus.SAMPLE_STATUS_OK and ok.reward == 1.0


def test_hung_replies_leave_asyncios_default_threads_free(tokenizer_dir: Path) -> None:
    """Replies ran in asyncio's default executor (6 threads on 2 cores), which the run loop's Redis writes and
    Submit use too: 6 hung replies blocked every one of them."""
    env, pool = StopsAnswering(hanging=8), ReplyPool(threads=2, timeout_s=1.0)
    ctx = replace(_context(tokenizer_dir, pool, FakeRouter(), max_turns=3), environment=env)
    ctx.spec.rollout.group_size = 8

    async def main() -> tuple[list[Sample], float]:
        producing = asyncio.create_task(multi_turn(ctx, _request()))
        async with asyncio.timeout(10):
            while env.calls < 2:
                await asyncio.sleep(0.01)
        started = time.monotonic()
        await asyncio.to_thread(int)
        waited = time.monotonic() - started
        return list((await producing).samples), waited

    try:
        samples, waited = asyncio.run(main())
    finally:
        env.release.set()
        pool.close()
    assert waited < 0.5
    assert [s.error for s in samples] == ["turn 1: environment did not reply within 1s"] * 8
    assert env.calls == 2, "the replies that found no free thread were dropped once their time was up"
