"""Helpers of the engine's tests: an engine as a real process, and logprobs from a plain forward pass."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlfleet.processes import ServiceProcess, free_port

ENGINE_START_TIMEOUT_S = 60.0


@dataclass
class RunningEngine:
    url: str
    process: ServiceProcess

    def post(self, path: str, body: Any, timeout: float = 30.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def generate(self, body: dict[str, Any], timeout: float = 30.0) -> Any:
        response = self.post("/generate", body, timeout)
        assert response.status_code == 200, response.text
        return response.json()


def start_engine(model_dir: Path, log_dir: Path, *extra: str) -> RunningEngine:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "rlfleet_engine",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--torch-threads",
        "1",
        *extra,
    ]
    process = ServiceProcess("engine", argv, log_dir / f"engine-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_healthy(url + "/health", timeout=ENGINE_START_TIMEOUT_S)
    except RuntimeError:
        process.stop()
        raise
    return RunningEngine(url=url, process=process)


def reference_logprobs(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each output token given everything before it, by one plain forward pass."""
    import torch

    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (T, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt) - 1
    return [float(logprobs[start + i, tok]) for i, tok in enumerate(output)]


def wait_until_running(engine: RunningEngine, count: int, timeout: float = 10.0) -> None:
    """Polls /get_server_info until `count` requests are decoding."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"] >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} requests were running within {timeout}s")
