"""OpenAI endpoints and multi-turn trajectories through the router, with a real engine serving the small model.

A 3-turn chat goes through the router under one trajectory id; the trajectory the router then
returns must hold exactly the token ids and logprobs the engine reported for every turn, with the
loss mask on the generated tokens only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlfleet.processes import ServiceProcess, free_port

pytestmark = pytest.mark.e2e

HEADER = "X-Rlfleet-Trajectory-Id"
TRAJECTORY = "run-1/group-0/sample-0"  # the README's form of id: slashes and all, in the URL path


@pytest.fixture(scope="module")
def router_url(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("trajectories")
    engine_port, router_port = free_port(), free_port()
    engine = ServiceProcess(
        "engine",
        [sys.executable, "-m", "rlfleet_engine", "--model-path", str(small_model_dir), "--port", str(engine_port),
         "--torch-threads", "1"],
        tmp_path / "engine.log",
    )  # fmt: skip
    router = ServiceProcess(
        "router",
        [sys.executable, "-m", "rlfleet_router", "--port", str(router_port),
         "--worker-urls", f"http://127.0.0.1:{engine_port}", "--health-check-interval-secs", "0.3"],
        tmp_path / "router.log",
    )  # fmt: skip
    try:
        engine.wait_healthy(f"http://127.0.0.1:{engine_port}/health", timeout=90)
        router.wait_healthy(f"http://127.0.0.1:{router_port}/health", timeout=30)
        yield f"http://127.0.0.1:{router_port}"
    finally:
        router.stop(timeout=10)
        engine.stop(timeout=10)


def test_three_turn_chat_trajectory_holds_the_engines_tokens_and_logprobs(router_url: str) -> None:
    client = httpx.Client(base_url=router_url, timeout=60, trust_env=False)
    messages: list[dict[str, str]] = [{"role": "user", "content": "12+7="}]
    turns = []
    for k in range(3):
        body = {
            "model": "small",
            "messages": messages,
            "max_tokens": 6,
            "logprobs": True,
            "return_token_ids": True,
            # Special tokens stay in the text, so the next turn's history tokenizes back to the same ids.
            "skip_special_tokens": False,
            "rid": f"conv-1-turn-{k}",
            "an_unknown_field": {"passes": "through"},
        }
        answer = client.post("/v1/chat/completions", json=body, headers={HEADER: TRAJECTORY})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert answer.json()["id"] == f"conv-1-turn-{k}", "the rid is kept"
        turns.append(choice)
        messages += [choice["message"], {"role": "tool", "content": f"result {k}"}]

    trajectory = client.get(f"/trajectories/{TRAJECTORY}")
    assert trajectory.status_code == 200, trajectory.text
    got = trajectory.json()
    assert got["prompt_ids"] == turns[0]["prompt_token_ids"]
    expected_ids: list[int] = []
    expected_logprobs: list[float] = []
    expected_mask: list[int] = []
    so_far = list(turns[0]["prompt_token_ids"])
    for choice in turns:
        prompt = choice["prompt_token_ids"]
        assert prompt[: len(so_far)] == so_far, "each turn's prompt extends the conversation's tokens"
        between = prompt[len(so_far) :]
        outputs = choice["response_token_ids"]  # a chat choice's, as SGLang names them
        logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert len(outputs) == len(logprobs) > 0
        expected_ids += between + outputs
        expected_logprobs += [0.0] * len(between) + logprobs
        expected_mask += [0] * len(between) + [1] * len(outputs)
        so_far = prompt + outputs
    assert got["response_ids"] == expected_ids
    assert got["response_logprobs"] == expected_logprobs
    assert got["loss_mask"] == expected_mask
    assert got["num_turns"] == 3 and got["weight_versions"] == ["default"]
    assert [t["rid"] for t in got["turns"]] == ["conv-1-turn-0", "conv-1-turn-1", "conv-1-turn-2"]

    refused = client.post("/v1/chat/completions", json={"messages": messages}, headers={HEADER: "conv-2"})
    assert refused.status_code == 400 and "return_token_ids" in refused.text
    assert client.delete(f"/trajectories/{TRAJECTORY}").status_code == 200
    assert client.get(f"/trajectories/{TRAJECTORY}").status_code == 404


def test_openai_requests_stream_through_the_router_and_control_requests_fan_out(router_url: str) -> None:
    client = httpx.Client(base_url=router_url, timeout=60, trust_env=False)
    completion = client.post("/v1/completions", json={"prompt": "3+4=", "max_tokens": 4, "logprobs": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion"
    assert len(completion.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
    ) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    for route in ("/pause_generation", "/continue_generation", "/flush_cache"):
        answer = client.post(route, json={})
        assert answer.status_code == 200 and answer.json()["engines"][0]["status"] == 200, answer.text
    aborted = client.post("/abort_request", json={"rid": "nothing-running"})
    assert aborted.status_code == 200
