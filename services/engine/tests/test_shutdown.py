"""An engine stops on SIGTERM within its bounded shutdown, whatever it holds: a paused engine kept its waiting
requests' connections open and uvicorn waited for them for ever (the launcher's SIGKILL ended it, and its clients saw
a reset connection). The requests still held are answered as aborted, with the tokens they have."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlfleet.processes import ServiceProcess, free_port
from rlfleet_engine import serving


@pytest.mark.parametrize("backend", ["sim", "transformers"])
def test_sigterm_stops_a_paused_engine_and_answers_what_it_held_as_aborted(
    backend: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    model = ["--backend", "sim", "--model-path", "sim"] if backend == "sim" else ["--model-path", str(tiny_model_dir)]
    argv = [sys.executable, "-m", "rlfleet_engine", *model, "--port", str(port)]
    process = ServiceProcess("engine", argv, tmp_path / "engine.log")
    url = f"http://127.0.0.1:{port}"
    answers: dict[str, Any] = {}
    try:
        process.wait_healthy(url + "/health", timeout=60)
        assert httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=10).status_code == 200

        def held() -> None:
            body = {"input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 8}, "rid": "held"}
            answers["held"] = httpx.post(f"{url}/generate", json=body, timeout=30)

        client = threading.Thread(target=held)
        client.start()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/get_server_info", timeout=5).json()["internal_states"][0]["num_queue_reqs"] < 1:
            assert time.monotonic() < deadline, "the request never reached the paused engine"
            time.sleep(0.05)

        signalled = time.monotonic()
        process.proc.send_signal(signal.SIGTERM)
        process.proc.wait(timeout=serving.SHUTDOWN_GRACE_S + 10)
        stopped_after = time.monotonic() - signalled
        client.join(timeout=10)
    finally:
        process.stop(timeout=10)
    assert stopped_after < serving.SHUTDOWN_GRACE_S + 3, f"stopped {stopped_after:.1f}s after SIGTERM"
    answer = answers["held"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
