"""What a run spec may make the hub do is bounded by the hub's settings, not by the spec: the code
sandbox's limits have caps, and `remote` / `judge` POST only to URLs the operator listed."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from google.protobuf import json_format
from pydantic import ValidationError

from rlfleet.errors import InvalidInput
from rlfleet.v1 import reward_pb2
from rlfleet_reward.config import RewardSettings
from rlfleet_reward.http_retry import MAX_ANSWER_BYTES, close_clients, post_json
from rlfleet_reward.llm_judge import JudgeParams
from rlfleet_reward.scoring import Scorer

WithScorer = Callable[..., Any]
SECRET = "engine-internal-state-do-not-leak"


def problems(with_scorer: WithScorer, *terms: dict) -> list[tuple[str, str]]:
    """(field, message) of every problem /validate finds in a spec of `terms`."""
    spec = json_format.ParseDict({"terms": list(terms)}, reward_pb2.RewardSpec())

    async def body(scorer: Scorer) -> list[tuple[str, str]]:
        answer = scorer.validate_spec(reward_pb2.ValidateSpecRequest(spec=spec))
        return [(p.field, p.message) for p in answer.problems]

    return with_scorer(body, workers=1)


def code(**params: Any) -> dict:
    return {"function": "code", "params": params}


def test_the_default_caps_keep_todays_defaults_valid_and_refuse_what_passes_them(with_scorer: WithScorer) -> None:
    assert problems(with_scorer, code()) == []
    assert problems(with_scorer, code(memory_mb=128, max_processes=16, file_size_mb=1)) == []
    found = dict(problems(with_scorer, code(memory_mb=16384, max_processes=1024, file_size_mb=1024)))
    assert set(found) == {
        "terms[0].params.memory_mb",
        "terms[0].params.max_processes",
        "terms[0].params.file_size_mb",
    }, found
    assert (
        "16384 is past the hub's cap of 1024 (RLFLEET_REWARD_CODE_MAX_MEMORY_MB)" in found["terms[0].params.memory_mb"]
    )
    assert "RLFLEET_REWARD_CODE_MAX_PROCESSES" in found["terms[0].params.max_processes"]
    assert "RLFLEET_REWARD_CODE_MAX_FILE_SIZE_MB" in found["terms[0].params.file_size_mb"]
    # Each within its own cap, but together past the total: 1024 MiB x 64 processes = 64 GiB.
    (total,) = problems(with_scorer, code(memory_mb=1024, max_processes=64))
    assert total[0] == "terms[0].params"
    assert "memory_mb x max_processes = 65536 MiB" in total[1], total
    assert "16384 MiB for one test (RLFLEET_REWARD_CODE_MAX_TOTAL_MEMORY_MB)" in total[1], total


def test_the_operator_sets_the_caps(with_scorer: WithScorer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_REWARD_CODE_MAX_MEMORY_MB", "256")
    monkeypatch.setenv("RLFLEET_REWARD_CODE_MAX_PROCESSES", "8")
    monkeypatch.setenv("RLFLEET_REWARD_CODE_MAX_TOTAL_MEMORY_MB", "1024")
    monkeypatch.setenv("RLFLEET_REWARD_CODE_MAX_FILE_SIZE_MB", "4")
    assert [field for field, _ in problems(with_scorer, code())] == [
        "terms[0].params.memory_mb",
        "terms[0].params.file_size_mb",
        "terms[0].params.max_processes",
    ]
    assert problems(with_scorer, code(memory_mb=128, max_processes=8, file_size_mb=4)) == []
    assert [field for field, _ in problems(with_scorer, code(memory_mb=256, max_processes=8, file_size_mb=4))] == [
        "terms[0].params"
    ]


def test_settings_refuse_caps_below_the_smallest_run_the_sandbox_takes() -> None:
    with pytest.raises(
        ValidationError, match="code_max_total_memory_mb\n  Input should be greater than or equal to 128"
    ):
        RewardSettings(code_max_memory_mb=512, code_max_processes=32, code_max_total_memory_mb=64)


def remote(url: str) -> dict:
    return {"function": "remote", "params": {"url": url}}


def test_remote_posts_to_no_url_the_operator_did_not_list(
    with_scorer: WithScorer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (refused,) = problems(with_scorer, remote("http://127.0.0.1:30001/pause_generation"))
    assert refused[0] == "terms[0].params.url"
    assert "RLFLEET_REWARD_REMOTE_URL_PREFIXES" in refused[1], refused
    monkeypatch.setenv("RLFLEET_REWARD_REMOTE_URL_PREFIXES", json.dumps(["http://rm:8080/score", "https://rm2/v1/"]))
    for allowed in (
        "http://rm:8080/score",
        "http://rm:8080/score/batch",
        "http://rm:8080/score?x=1",
        "https://rm2/v1/a",
    ):
        assert problems(with_scorer, remote(allowed)) == [], allowed
    for url in (
        "http://rm:8080/scoreboard",  # a prefix of the path, not of its segments
        "http://rm:8080@engine:30001/score",  # userinfo that a plain string prefix would take for the host
        "http://rm:80801/score",
        "https://rm:8080/score",
        "http://rm:8080/score/../pause_generation",
        "http://rm:8080/score/..%2fpause_generation",  # a server that decodes %2F before routing reads `..`
        "http://rm:8080/score/..%5Cpause_generation",
        "http://rm2/v1/a",
        "http://engine:30001/score",
    ):
        assert [field for field, _ in problems(with_scorer, remote(url))] == ["terms[0].params.url"], url


def test_judge_posts_only_to_listed_routers(with_scorer: WithScorer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(with_scorer, {"function": "judge"}) == []  # the default router, allowed by default
    for router_url in (
        "http://127.0.0.1:30001",
        "http://127.0.0.1:30000/pause_generation?x=",
        "http://a@127.0.0.1:30000",
    ):
        found = problems(with_scorer, {"function": "judge", "params": {"router_url": router_url}})
        assert [field for field, _ in found] == ["terms[0].params.router_url"], (router_url, found)
        assert "RLFLEET_REWARD_JUDGE_ROUTER_URLS" in found[0][1]
    monkeypatch.setenv("RLFLEET_REWARD_JUDGE_ROUTER_URLS", '["http://router:30000/", "http://router-b:30000"]')
    assert problems(with_scorer, {"function": "judge", "params": {"router_url": "http://router:30000"}}) == []
    # Left out, router_url is the first router listed (before, 127.0.0.1:30000, refused here).
    assert problems(with_scorer, {"function": "judge"}) == []
    assert str(JudgeParams().router_url) == "http://router:30000/"
    monkeypatch.setenv("RLFLEET_REWARD_JUDGE_ROUTER_URLS", "[]")
    found = problems(with_scorer, {"function": "judge"})
    assert [field for field, _ in found] == ["terms[0].params.router_url"] and "none" in found[0][1], found


@pytest.fixture
def answers() -> Iterator[tuple[dict[str, tuple[int, bytes]], str]]:
    """A server answering each path with the (status, body) set in the dict."""
    table: dict[str, tuple[int, bytes]] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = table[self.path]
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if self.path.startswith(("/gzip", "/br")):  # compressed whatever the hub asked
                self.send_header("Content-Encoding", self.path[1:].split("-")[0])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the hub stopped reading
                pass

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield table, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def post(url: str) -> Any:
    async def call() -> Any:
        try:
            return await post_json(url, {}, attempt_seconds=5, deadline_seconds=5)
        finally:
            await close_clients()

    return asyncio.run(call())


def test_an_answer_is_read_up_to_a_cap(answers: tuple[dict[str, tuple[int, bytes]], str]) -> None:
    table, url = answers
    table["/small"] = (200, b'{"score": 1}')
    table["/big"] = (200, b'{"score": 1, "pad": "' + b"x" * (4 * MAX_ANSWER_BYTES) + b'"}')
    assert post(f"{url}/small") == {"score": 1}
    with pytest.raises(InvalidInput, match="more than 1 MiB"):
        post(f"{url}/big")


def test_a_compressed_answer_is_inflated_no_further_than_the_cap(
    answers: tuple[dict[str, tuple[int, bytes]], str],
) -> None:
    """Before, httpx inflated each network read whole before the cap was checked: 64 KiB of gzip sat in memory as
    64 MiB, in each of up to 64 calls at once."""
    table, url = answers
    table["/gzip-small"] = (200, gzip.compress(b'{"score": 1}'))
    table["/gzip-bomb"] = (200, gzip.compress(b" " * (64 << 20)))  # 64 KiB that inflate to 64 MiB
    table["/br"] = (200, b"not read")
    assert post(f"{url}/gzip-small") == {"score": 1}
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="more than 1 MiB"):
            post(f"{url}/gzip-bomb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MiB held"
    with pytest.raises(InvalidInput, match="Content-Encoding 'br'; the hub reads identity or gzip"):
        post(f"{url}/br")


def test_errors_name_the_status_and_never_echo_the_answer(
    answers: tuple[dict[str, tuple[int, bytes]], str], with_scorer: WithScorer, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, url = answers
    table["/refused"] = (404, json.dumps({"detail": SECRET}).encode())
    table["/garbled"] = (200, SECRET.encode())
    table["/no_score"] = (200, json.dumps({"paused": SECRET}).encode())
    table["/generate"] = (200, json.dumps({"error": SECRET}).encode())
    with pytest.raises(InvalidInput) as refused:
        post(f"{url}/refused")
    assert "HTTP 404" in str(refused.value) and SECRET not in str(refused.value)
    with pytest.raises(InvalidInput) as garbled:
        post(f"{url}/garbled")
    assert "invalid JSON" in str(garbled.value) and SECRET not in str(garbled.value)

    monkeypatch.setenv("RLFLEET_REWARD_REMOTE_URL_PREFIXES", json.dumps([url]))
    monkeypatch.setenv("RLFLEET_REWARD_JUDGE_ROUTER_URLS", json.dumps([url]))
    request = json_format.ParseDict(
        {
            "spec": {"terms": [{"function": "remote", "params": {"url": f"{url}/no_score"}}], "timeout_seconds": 5},
            "items": [{"response": "a"}],
        },
        reward_pb2.ScoreRequest(),
    )
    judged = reward_pb2.ScoreRequest()
    judged.CopyFrom(request)
    judged.spec.terms[0].CopyFrom(
        json_format.ParseDict({"function": "judge", "params": {"router_url": url}}, reward_pb2.RewardTerm())
    )

    async def body(scorer: Scorer) -> list[str]:
        return [(await scorer.score(r)).results[0].error for r in (request, judged)]

    errors = with_scorer(body, workers=1)
    assert all(error and SECRET not in error for error in errors), errors
    assert "'score'" in errors[0] and "text" in errors[1], errors


def test_a_judge_pattern_needs_exactly_one_group_within_its_length(with_scorer: WithScorer) -> None:
    """With two groups the verdict was read from the first alone, so `Grade: (\\d+)|Score: (\\d+)` read every
    `Score: 7` as no verdict (0) while /validate said the spec was fine; the pattern had no length bound (2 MB of
    it held the hub's event loop 4 s compiling)."""
    judge = {"function": "judge"}
    assert problems(with_scorer, {**judge, "params": {"verdict_pattern": r"(?i)verdict: (\w+)"}}) == []
    for pattern, message in [
        (r"Grade: (\d+)|Score: (\d+)", "exactly one capturing group, the verdict; it has 2"),
        (r"Score: \d+", "exactly one capturing group, the verdict; it has 0"),
        ("(" * 1000 + "a" + ")" * 1000, "nested too deeply"),
        ("a" * 10_001, "at most 10000 characters"),
    ]:
        [(field, found)] = problems(with_scorer, {**judge, "params": {"verdict_pattern": pattern}})
        assert field == "terms[0].params.verdict_pattern" and message in found, (pattern[:30], found)


def test_code_refuses_a_file_size_of_0(with_scorer: WithScorer) -> None:
    """The sandbox could write no output: every test of every item failed (`code/output_limit`), scoring 0."""
    [(field, message)] = problems(with_scorer, code(file_size_mb=0))
    assert field == "terms[0].params.file_size_mb" and "greater than or equal to 1" in message, message
