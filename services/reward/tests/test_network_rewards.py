"""`remote` and `judge` against a real HTTP server on loopback: retries, deadlines, parsed verdicts."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from pydantic import ValidationError

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.v1 import reward_pb2
from rlfleet_reward.llm_judge import JudgeParams, parse_verdict
from rlfleet_reward.scoring import Scorer

WithScorer = Callable[..., Any]
OK, ERROR, TIMEOUT = reward_pb2.SCORE_STATUS_OK, reward_pb2.SCORE_STATUS_ERROR, reward_pb2.SCORE_STATUS_TIMEOUT


class FakeModels:
    """`/score`: 503 for the first `failures` calls, then a score; `/generate` and `/v1/chat/completions`: a judge,
    which says `judge_text` and stops for `judge_finish`; `/slow`: never answers."""

    def __init__(self) -> None:
        self.failures = 0
        self.calls: list[tuple[str, dict]] = []
        self.client_ports: list[int] = []
        self.judge_text = "The answer is right.\nScore: 7"
        self.judge_finish = "stop"
        self.chat_answer: object = None  # in place of the judge's chat completion, when set
        self.judge_failures = 0
        self.judge_aborts = 0
        self.remote_answer: object = None


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeModels, str]]:
    state = FakeModels()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a model server behind HTTP/1.1 offers

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.calls.append((self.path, body))
            state.client_ports.append(self.client_address[1])
            if self.path == "/slow":
                time.sleep(3)
            if self.path == "/score" and state.failures > 0:
                state.failures -= 1
                return self._send(503, {"error": "warming up"})
            if self.path == "/score":
                return self._send(200, {"score": len(body["response"]) / 10, "components": {"length": 1.0}})
            if self.path == "/shaped":
                return self._send(200, state.remote_answer)
            if state.judge_failures > 0:
                state.judge_failures -= 1
                return self._send(503, {"error": "no engine"})
            if state.judge_aborts > 0:
                # What an engine gives a generation `abort_all` stopped: the text it had written by then.
                state.judge_aborts -= 1
                return self._judge("The answer looks wrong.\nScore: 1", "abort")
            return self._judge(state.judge_text, state.judge_finish)

        def _judge(self, text: str, finish: str) -> None:
            """The judge's answer in SGLang's shape for the route asked."""
            if self.path == "/v1/chat/completions":
                if state.chat_answer is not None:
                    return self._send(200, state.chat_answer)
                message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
                choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
                return self._send(200, {"id": "c", "object": "chat.completion", "choices": [choice]})
            meta = {"type": finish, "message": "Abort in running batch"} if finish == "abort" else {"type": finish}
            return self._send(200, {"text": text, "meta_info": {"finish_reason": meta}})

        def _send(self, status: int, document: object) -> None:
            data = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    # The hub POSTs only where its operator allows; here, to this server.
    monkeypatch.setenv("RLFLEET_REWARD_REMOTE_URL_PREFIXES", json.dumps([url]))
    monkeypatch.setenv("RLFLEET_REWARD_JUDGE_ROUTER_URLS", json.dumps([url]))
    try:
        yield state, url
    finally:
        server.shutdown()
        server.server_close()


def score(with_scorer: WithScorer, terms: list[dict], items: list[dict], timeout: float = 5) -> list[Any]:
    request = json_format.ParseDict(
        {"spec": {"terms": terms, "timeout_seconds": timeout}, "items": items}, reward_pb2.ScoreRequest()
    )

    async def body(scorer: Scorer) -> reward_pb2.ScoreResponse:
        return await scorer.score(request)

    return list(with_scorer(body, workers=1).results)


def test_remote_retries_a_failing_model_then_reports_its_components(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    state, url = models
    state.failures = 2
    (result,) = score(with_scorer, [{"function": "remote", "params": {"url": f"{url}/score"}}],
                      [{"prompt": "p", "response": "abcd", "label": "l", "metadata": {"k": "v"}}])  # fmt: skip
    assert (result.status, result.score) == (OK, pytest.approx(0.4))
    assert dict(result.components) == {"remote": pytest.approx(0.4), "remote/length": 1.0}
    assert len(state.calls) == 3
    assert state.calls[-1][1] == {"prompt": "p", "response": "abcd", "label": "l", "metadata": {"k": "v"}}


def test_remote_items_reuse_the_connections_of_earlier_ones(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    """Opening (for HTTPS, handshaking) one connection per item made every item pay for it."""
    state, url = models
    request = json_format.ParseDict(
        {
            "spec": {"terms": [{"function": "remote", "params": {"url": f"{url}/score"}}]},
            "items": [{"response": "ab"}] * 4,
        },
        reward_pb2.ScoreRequest(),
    )

    async def twice(scorer: Scorer) -> list[reward_pb2.ScoreResponse]:
        return [await scorer.score(request), await scorer.score(request)]

    answers = with_scorer(twice, workers=1)
    assert [r.status for answer in answers for r in answer.results] == [OK] * 8
    assert len(state.client_ports) == 8
    assert len(set(state.client_ports)) <= 4, state.client_ports  # the second batch used the first's


def test_remote_gives_up_at_its_deadline_and_the_item_limit_still_holds(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    state, url = models
    state.failures = 1000
    unavailable, stuck = score(
        with_scorer,
        [{"function": "remote", "params": {"url": f"{url}/score", "deadline_seconds": 0.5}}],
        [{"response": "a"}],
    ) + score(with_scorer, [{"function": "remote", "params": {"url": f"{url}/slow"}}], [{"response": "a"}], timeout=0.5)
    assert unavailable.status == ERROR
    assert "did not succeed within 0.5 s (last: HTTP 503" in unavailable.error
    assert (stuck.status, stuck.error) == (TIMEOUT, "remote: exceeded its 0.5 s time limit")


def test_judge_renders_the_template_and_parses_the_verdict(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    state, url = models
    template = "Q: {prompt} | ref: {label} | A: {response} | {not a field}"
    numeric, worded = score(
        with_scorer,
        [{"function": "judge", "params": {"router_url": url, "template": template, "max_new_tokens": 8}}],
        [{"prompt": "2+2?", "response": "4", "label": "4"}],
    ) + score(
        with_scorer,
        [{"function": "judge", "params": {"router_url": url, "verdict_pattern": r"(?i)answer is (right|wrong)",
                                          "verdicts": {"RIGHT": 1, "wrong": 0}}}],
        [{"prompt": "2+2?", "response": "4", "label": "4"}],
    )  # fmt: skip
    assert (numeric.status, numeric.score) == (OK, pytest.approx(0.7))
    assert (worded.status, worded.score) == (OK, 1.0)
    path, body = state.calls[0]
    assert path == "/generate"
    assert body == {
        "text": "Q: 2+2? | ref: 4 | A: 4 | {not a field}",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "rid": body["rid"],
    }
    assert dict(numeric.components) == {"judge": pytest.approx(0.7), "judge/no_verdict": 0.0, "judge/truncated": 0.0}


@pytest.mark.parametrize(
    "judge_text",
    ["I cannot decide.", "Perfect.\nScore: 100", "Score: -40", "Score: 10.5", "The answer is fine"],
)
def test_a_judge_text_without_a_verdict_in_range_scores_0_and_says_so(
    with_scorer: WithScorer, models: tuple[FakeModels, str], judge_text: str
) -> None:
    """A response that stops the judge deciding, or talks it into a score past its scale, gains nothing: an
    ERROR would drop the sample from training (no penalty), and 100/10 was worth ten right answers."""
    state, url = models
    state.judge_text = judge_text
    worded = {"verdict_pattern": r"(?i)answer is (right|wrong|fine)", "verdicts": {"right": 1, "wrong": 0}}
    params = worded if judge_text.startswith("The answer") else {}
    (undecided,) = score(
        with_scorer, [{"function": "judge", "params": {"router_url": url, **params}}], [{"response": "4"}]
    )
    assert (undecided.status, undecided.score) == (OK, 0.0), undecided.error
    assert dict(undecided.components) == {"judge": 0.0, "judge/no_verdict": 1.0, "judge/truncated": 0.0}


def test_a_judge_text_without_a_verdict_is_logged_by_the_hub_from_its_worker(
    models: tuple[FakeModels, str], tmp_path: Path
) -> None:
    """The README promises the line; it was logged in a worker process, which had no logging set up, so it went
    nowhere (anything a function logged below WARNING did)."""
    state, url = models
    state.judge_text = "I cannot decide."
    port = free_port()
    argv = [sys.executable, "-m", "rlfleet_reward", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"]
    env = {"RLFLEET_LOG_FORMAT": "text", "RLFLEET_REWARD_JUDGE_ROUTER_URLS": json.dumps([url])}
    hub = ServiceProcess("reward-hub", [*argv, "--workers", "1", "--log-level", "info"], tmp_path / "hub.log", env=env)
    try:
        hub.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30)
        body = {"spec": {"terms": [{"function": "judge", "params": {"router_url": url}}]}, "items": [{"response": "4"}]}
        answer = httpx.post(f"http://127.0.0.1:{port}/score", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["results"][0]["components"]["judge/no_verdict"] == 1.0
    finally:
        hub.stop(timeout=10)
    assert "INFO rlfleet_reward.llm_judge: the judge gave no verdict matching" in hub.log_tail(200), hub.log_tail()


def test_a_verdict_pattern_that_backtracks_forever_is_a_timeout_and_leaves_the_event_loop_free(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    """`(a+)+b` over a run of `a`s backtracks for seconds to minutes (47.7 s at 28 of them); parsed on the
    hub's event loop it held every request and /health, and no time limit could stop it."""
    state, url = models
    state.judge_text = "a" * 26
    request = json_format.ParseDict(
        {
            "spec": {
                "terms": [{"function": "judge", "params": {"router_url": url, "verdict_pattern": "(a+)+b"}}],
                "timeout_seconds": 1,
            },
            "items": [{"response": "4"}],
        },
        reward_pb2.ScoreRequest(),
    )

    async def body(scorer: Scorer) -> tuple[reward_pb2.ScoreResponse, float, float]:
        longest_gap = 0.0

        async def tick() -> None:
            nonlocal longest_gap
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.02)
                longest_gap = max(longest_gap, time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        try:
            response = await scorer.score(request)
        finally:
            ticker.cancel()
        return response, time.monotonic() - started, longest_gap

    response, elapsed, longest_gap = with_scorer(body, workers=1)
    (result,) = response.results
    assert (result.status, result.error) == (TIMEOUT, "judge: exceeded its 1 s time limit")
    assert elapsed < 2.5
    assert longest_gap < 0.5


@pytest.mark.parametrize("answer", [{"score": 0.5, "components": 0}, {"score": 0.5, "components": []},
                                    {"score": 0.5, "components": False}, {"score": 0.5, "components": ""}])  # fmt: skip
def test_remote_components_that_are_not_an_object_are_an_error_even_when_falsy(
    with_scorer: WithScorer, models: tuple[FakeModels, str], answer: dict
) -> None:
    """`or {}` took `0`, `[]`, `false` and `""` for no components: a model answering in another shape than the
    spec expects went unnoticed, its score taken alone."""
    state, url = models
    state.remote_answer = answer
    (result,) = score(with_scorer, [{"function": "remote", "params": {"url": f"{url}/shaped"}}], [{"response": "a"}])
    assert result.status == ERROR
    assert "'components' in the reward model's answer is not an object" in result.error


def test_remote_components_null_is_none(with_scorer: WithScorer, models: tuple[FakeModels, str]) -> None:
    state, url = models
    state.remote_answer = {"score": 0.5, "components": None}
    (result,) = score(with_scorer, [{"function": "remote", "params": {"url": f"{url}/shaped"}}], [{"response": "a"}])
    assert (result.status, dict(result.components)) == (OK, {"remote": 0.5})


@pytest.mark.parametrize("api", [{}, {"api": "chat"}], ids=["generate", "chat"])
def test_a_judge_generation_the_engine_aborted_is_asked_again_not_read_as_its_verdict(
    with_scorer: WithScorer, models: tuple[FakeModels, str], api: dict
) -> None:
    """A weight update's `abort_all` stops the judge's generation too when it shares the policy's fleet; its cut
    text ("Score: 1", or no verdict at all) was read as the verdict, and a right answer scored 0.1."""
    state, url = models
    state.judge_failures, state.judge_aborts = 1, 2
    params = {"router_url": url, **api}
    (result,) = score(with_scorer, [{"function": "judge", "params": params}], [{"response": "4"}])
    assert (result.status, result.score) == (OK, pytest.approx(0.7)), result.error
    assert dict(result.components) == {"judge": pytest.approx(0.7), "judge/no_verdict": 0.0, "judge/truncated": 0.0}
    assert len(state.calls) == 4
    assert {path for path, _ in state.calls} == {"/v1/chat/completions" if api else "/generate"}


@pytest.mark.parametrize("api", [{}, {"api": "chat"}], ids=["generate", "chat"])
def test_each_judge_attempt_carries_a_request_id_of_its_own(
    with_scorer: WithScorer, models: tuple[FakeModels, str], api: dict
) -> None:
    """Without a `rid` the router cannot stop at the engine a generation the hub gave up on (past the attempt's or
    the item's time limit): it ran to max_new_tokens for nobody, beside the retry. A retry under the same rid could
    be refused as a duplicate of the attempt still being aborted."""
    state, url = models
    state.judge_failures, state.judge_aborts = 1, 1
    score(with_scorer, [{"function": "judge", "params": {"router_url": url, **api}}], [{"response": "4"}] * 2)
    rids: list[str] = [body["rid"] for _, body in state.calls]
    assert len(rids) == 4 and all(isinstance(rid, str) and rid for rid in rids), rids
    assert len(set(rids)) == 4
    # The router's aborts go by prefix: no rid may start with another.
    assert not any(a != b and b.startswith(a) for a in rids for b in rids)


def test_a_judge_aborted_until_its_deadline_is_an_error_naming_why(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    state, url = models
    state.judge_aborts = 1000
    params = {"router_url": url, "deadline_seconds": 0.5}
    (result,) = score(with_scorer, [{"function": "judge", "params": params}], [{"response": "4"}])
    assert result.status == ERROR
    assert "the engine aborted every generation of the judge for 0.5 s" in result.error


def test_a_response_too_long_for_the_judge_reaches_it_cut_in_the_middle(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    """Sent whole, a response past the judge's context is refused by the engine (HTTP 400): an ERROR, which drops
    the sample, so a long enough response escaped the judge's penalty."""
    state, url = models
    response = "start " + "x" * 200_000 + " end"
    params = {"router_url": url, "template": "{response}", "max_response_chars": 1000}
    (result,) = score(with_scorer, [{"function": "judge", "params": params}], [{"response": response}])
    assert result.status == OK, result.error
    sent = state.calls[0][1]["text"]
    assert sent.startswith("start xxx") and sent.endswith("xxx end")
    assert f"\n[... {len(response) - 1000} characters cut ...]\n" in sent
    assert len(sent) < 1100
    (default,) = score(with_scorer, [{"function": "judge", "params": {"router_url": url}}], [{"response": response}])
    assert default.status == OK and len(state.calls[1][1]["text"]) < 17_000


@pytest.mark.parametrize(
    ("judge_text", "expected"),
    [
        ("Reasoning...\nScore: 7/10", 0.7),
        ("**Score:** 8", 0.8),
        ("**Score**: 8", 0.8),
        ("Score: **9**", 0.9),
        ("__Score__ = 6.5", 0.65),
        ("The response says Score: 10 itself, which counts for nothing.\nScore: 3", 0.3),
    ],
)
def test_the_default_verdict_pattern_reads_the_last_score_markdown_or_not(judge_text: str, expected: float) -> None:
    """Judges often write their verdict in Markdown bold; "**Score:** 8" held no verdict and scored 0."""
    params = JudgeParams().model_dump()
    assert parse_verdict(judge_text, params) == pytest.approx(expected)


def test_a_chat_judge_gets_the_template_as_the_user_message_after_the_system(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    """An instruct-tuned judge sent raw text gets no chat template: it reads its prompt unlike anything it was
    trained on, and a response can close the user's turn and write the judge's verdict itself."""
    state, url = models
    template = "Q: {prompt} A: {response}"
    params = {
        "router_url": url,
        "api": "chat",
        "system": "Grade answers to {prompt}.",
        "template": template,
        "max_new_tokens": 8,
    }
    (result,) = score(with_scorer, [{"function": "judge", "params": params}], [{"prompt": "2+2?", "response": "4"}])
    assert (result.status, result.score) == (OK, pytest.approx(0.7)), result.error
    assert dict(result.components) == {"judge": pytest.approx(0.7), "judge/no_verdict": 0.0, "judge/truncated": 0.0}
    [(path, body)] = state.calls
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "default",
        "messages": [
            {"role": "system", "content": "Grade answers to {prompt}."},
            {"role": "user", "content": "Q: 2+2? A: 4"},
        ],
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": False,
        "rid": body["rid"],
    }
    score(with_scorer, [{"function": "judge", "params": {"router_url": url, "api": "chat"}}], [{"response": "4"}])
    assert [message["role"] for message in state.calls[1][1]["messages"]] == ["user"]


def test_a_system_message_without_the_chat_api_is_refused_naming_both() -> None:
    """A raw /generate prompt has no system turn: the message would have been dropped without a word."""
    with pytest.raises(ValidationError, match='system is sent only as a chat message: set api "chat"'):
        JudgeParams(system="Be strict.")
    assert JudgeParams(api="chat", system="Be strict.").system == "Be strict."


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": []},
        {"choices": [{"index": 0, "finish_reason": "stop"}]},
        {"choices": [{"index": 0, "message": {"content": ["SECRET Score: 9"]}, "finish_reason": "stop"}]},
        ["SECRET"],
    ],
)
def test_a_chat_answer_without_a_text_is_an_error_naming_what_is_missing_not_quoting_it(
    with_scorer: WithScorer, models: tuple[FakeModels, str], answer: object
) -> None:
    state, url = models
    state.chat_answer = answer
    (result,) = score(with_scorer, [{"function": "judge", "params": {"router_url": url, "api": "chat"}}],
                      [{"response": "4"}])  # fmt: skip
    assert result.status == ERROR
    assert "/v1/chat/completions answered with" in result.error and "choices[0].message" in result.error
    assert "SECRET" not in result.error


def test_a_chat_judge_that_wrote_only_reasoning_gave_no_verdict(
    with_scorer: WithScorer, models: tuple[FakeModels, str]
) -> None:
    """SGLang's reasoning parser leaves `content` null when the judge's text was all reasoning: no verdict, not an
    ERROR that would drop the sample."""
    state, url = models
    message = {"role": "assistant", "content": None, "reasoning_content": "Hmm. Score: 9 maybe"}
    state.chat_answer = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
    (result,) = score(with_scorer, [{"function": "judge", "params": {"router_url": url, "api": "chat"}}],
                      [{"response": "4"}])  # fmt: skip
    assert (result.status, result.score) == (OK, 0.0), result.error
    assert dict(result.components) == {"judge": 0.0, "judge/no_verdict": 1.0, "judge/truncated": 0.0}


@pytest.mark.parametrize("api", [{}, {"api": "chat"}], ids=["generate", "chat"])
@pytest.mark.parametrize(
    "judge_text",
    [
        "The answer is right.\nScore: 1",  # of "Score: 10", cut
        "At first sight Score: 8, but the second step",  # a tentative score in the judge's reasoning
        "Score: 9\nThe response also says",  # a verdict, then more: the judge had not stopped
    ],
)
def test_a_judge_text_cut_at_max_new_tokens_holds_no_verdict_and_says_so(
    with_scorer: WithScorer, models: tuple[FakeModels, str], api: dict, judge_text: str
) -> None:
    """Cut before the judge finished, its last match was read as its verdict: a score cut short, or one it wrote
    on the way, which a response that keeps the judge talking could choose."""
    state, url = models
    state.judge_text, state.judge_finish = judge_text, "length"
    (result,) = score(with_scorer, [{"function": "judge", "params": {"router_url": url, **api}}],
                      [{"response": "4"}])  # fmt: skip
    assert (result.status, result.score) == (OK, 0.0), result.error
    assert dict(result.components) == {"judge": 0.0, "judge/no_verdict": 1.0, "judge/truncated": 1.0}
    assert len(state.calls) == 1  # scored, not asked again: at the same budget the judge would stop as short
