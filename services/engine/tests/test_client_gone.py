"""A whole answer whose client leaves stops at once, its batch row free for others (as SGLang aborts it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest


def running(url: str) -> int:
    return int(httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]["num_running_reqs"])


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}),
        ("/v1/completions", {"model": "sim", "prompt": "hello", "max_tokens": 5000, "ignore_eos": True}),
    ],
)
def test_a_whole_answer_is_aborted_when_its_client_leaves(
    start_sim: Callable[..., str], route: str, body: dict[str, object]
) -> None:
    url = start_sim("--sim-decode-ms-per-step", "2")  # 5,000 steps: about 10 s of decoding
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + route, json=body, timeout=httpx.Timeout(10, read=0.5))
    left = time.monotonic()
    while running(url) and time.monotonic() - left < 5:
        time.sleep(0.05)
    assert running(url) == 0, "the engine still decodes for a client that left"
    answer = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert answer.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_aborts_its_own_request_only(start_sim: Callable[..., str], stream: bool) -> None:
    url = start_sim("--sim-decode-ms-per-step", "2")
    result: dict[str, Any] = {}
    other = {"text": "hi", "rid": "job_1", "sampling_params": {"max_new_tokens": 1000}}  # about 2 s of decoding
    worker = threading.Thread(target=lambda: result.update(out=httpx.post(url + "/generate", json=other, timeout=30)))
    worker.start()
    while not running(url):
        time.sleep(0.01)
    # rid "job" is not "job_1"'s batch: "job" leaving must not take "job_1" with it.
    leaving = {"text": "hello", "rid": "job", "stream": stream, "sampling_params": {"max_new_tokens": 1000}}
    if stream:
        with httpx.stream("POST", url + "/generate", json=leaving, timeout=10) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/generate", json=leaving, timeout=httpx.Timeout(10, read=0.5))
    worker.join(timeout=30)
    assert result["out"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 1000}
