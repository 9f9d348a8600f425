"""/pause_generation's modes and /health_generate while paused.

"abort" (the default) ends every request in flight with what it has, "retract" and "in_place" hold them; in
every mode new requests wait for /continue_generation. A paused engine is healthy for as long as a weight load
may take (--max-pause), then 503, so an engine that a lost /continue_generation left paused is taken out and
restarted."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_test_support import start_engine

pytestmark = pytest.mark.e2e
PROMPT = [20, 21, 22, 23]
LONG = 500  # tokens: the tiny model's context (512) less the prompt, so a request is still running when paused
SHORT = {"max_new_tokens": 8, "ignore_eos": True}


@contextlib.contextmanager
def serving(
    backend: str, tiny_model_dir: Path, tmp_path: Path, start_sim: Callable[..., str], *extra: str
) -> Iterator[str]:
    """The URL of a fresh engine of `backend` started with `extra` flags, stopped afterwards."""
    if backend == "sim":
        yield start_sim(*extra)  # the fixture stops it
        return
    engine = start_engine(tiny_model_dir, tmp_path, *extra)
    try:
        yield engine.url
    finally:
        engine.process.stop()


def generate_in_background(url: str, body: dict[str, Any], into: dict[str, Any], key: str) -> threading.Thread:
    def run() -> None:
        response = httpx.post(f"{url}/generate", json=body, timeout=60)
        into[key] = response.json() if response.status_code == 200 else response.text

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def wait_for_counts(url: str, running: int, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]
        if (state["num_running_reqs"], state["num_queue_reqs"]) == (running, waiting):
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine did not reach {running} running and {waiting} waiting within {timeout}s")


def tokens_generated(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:generation_tokens_total{")
    )


def pause(url: str, body: dict[str, Any] | None) -> httpx.Response:
    if body is None:
        return httpx.post(f"{url}/pause_generation", timeout=30)  # no body at all
    return httpx.post(f"{url}/pause_generation", json=body, timeout=30)


@pytest.mark.parametrize(("backend", "body"), [("transformers", {"mode": "abort"}), ("sim", None), ("sim", {})])
def test_abort_mode_answers_requests_in_flight_with_their_tokens_and_holds_new_ones(
    backend: str, body: dict[str, Any] | None, tiny_model_dir: Path, tmp_path: Path, start_sim: Callable[..., str]
) -> None:
    results: dict[str, Any] = {}
    with serving(backend, tiny_model_dir, tmp_path, start_sim, "--max-running-requests", "1") as url:
        running = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
        with httpx.stream("POST", f"{url}/generate", json=running, timeout=10) as stream:
            events = (line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: "))
            assert json.loads(next(events))["meta_info"]["finish_reason"] is None  # a token is out: it runs
            queued = generate_in_background(url, {"input_ids": PROMPT, "sampling_params": SHORT}, results, "queued")
            wait_for_counts(url, running=1, waiting=1)
            paused = pause(url, body)
            assert paused.status_code == 200, paused.text
            assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
            rest = list(events)
        queued.join(timeout=10)

        assert rest[-1] == "[DONE]"
        last = json.loads(rest[-2])
        assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in running batch"}
        assert 0 < len(last["output_ids"]) == last["meta_info"]["completion_tokens"] < LONG
        meta = results["queued"]["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert results["queued"]["output_ids"] == [] and meta["completion_tokens"] == 0

        # Paused all the same: a request sent now waits for /continue_generation.
        late = generate_in_background(url, {"input_ids": PROMPT, "sampling_params": SHORT}, results, "late")
        late.join(timeout=1.0)
        assert late.is_alive() and "late" not in results
        state = httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]
        assert state["paused"] is True and (state["num_running_reqs"], state["num_queue_reqs"]) == (0, 1)
        assert httpx.post(f"{url}/continue_generation", json={}, timeout=10).status_code == 200
        late.join(timeout=30)
    assert results["late"]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


@pytest.mark.parametrize(("backend", "mode"), [("transformers", "retract"), ("sim", "retract"), ("sim", "in_place")])
def test_retract_and_in_place_hold_requests_in_flight_until_continue(
    backend: str, mode: str, tiny_model_dir: Path, tmp_path: Path, start_sim: Callable[..., str]
) -> None:
    length = 300  # a second or more of decoding on either backend: still running when paused
    params = {"max_new_tokens": length, "ignore_eos": True}
    results: dict[str, Any] = {}
    with serving(backend, tiny_model_dir, tmp_path, start_sim, "--max-running-requests", "1") as url:
        first = generate_in_background(url, {"input_ids": PROMPT, "sampling_params": params}, results, "running")
        wait_for_counts(url, running=1, waiting=0)
        second = generate_in_background(url, {"input_ids": PROMPT, "sampling_params": params}, results, "queued")
        wait_for_counts(url, running=1, waiting=1)
        paused = pause(url, {"mode": mode})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}

        before = tokens_generated(url)  # the pause answered once the step under way had ended
        time.sleep(0.5)
        assert tokens_generated(url) == before  # nothing decodes while paused
        assert first.is_alive() and second.is_alive() and not results
        wait_for_counts(url, running=1, waiting=1, timeout=0.1)  # both still where they were
        assert httpx.post(f"{url}/continue_generation", json={}, timeout=10).status_code == 200
        first.join(timeout=60)
        second.join(timeout=60)
    for key in ("running", "queued"):
        assert results[key]["meta_info"]["finish_reason"] == {"type": "length", "length": length}
        assert len(results[key]["output_ids"]) == length


@pytest.mark.parametrize("backend", ["transformers", "sim"])
def test_an_engine_paused_past_its_bound_fails_its_generation_probe(
    backend: str, tiny_model_dir: Path, tmp_path: Path, start_sim: Callable[..., str]
) -> None:
    with serving(backend, tiny_model_dir, tmp_path, start_sim, "--max-pause", "1") as url:
        assert httpx.post(f"{url}/pause_generation", json={}, timeout=10).status_code == 200
        assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 200  # a weight load takes a while
        time.sleep(1.3)
        assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 503
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # alive: only generation is stuck
        assert httpx.post(f"{url}/continue_generation", json={}, timeout=10).status_code == 200
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
