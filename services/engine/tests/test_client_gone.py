"""A whole answer whose client leaves stops at once, its batch row free for others (as SGLang aborts it)."""

from __future__ import annotations

import time
from collections.abc import Callable

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
