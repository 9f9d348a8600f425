"""/health_generate while generation is paused: healthy for as long as a weight load may take (--max-pause), then
503, so an engine that a lost /continue_generation left paused is taken out and restarted."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from engine_test_support import start_engine

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("backend", ["transformers", "sim"])
def test_an_engine_paused_past_its_bound_fails_its_generation_probe(
    backend: str, tiny_model_dir: Path, tmp_path: Path, start_sim: Callable[..., str]
) -> None:
    if backend == "sim":
        url = start_sim("--max-pause", "1")
    else:
        engine = start_engine(tiny_model_dir, tmp_path, "--max-pause", "1")
        url = engine.url
    try:
        assert httpx.post(f"{url}/pause_generation", json={}, timeout=10).status_code == 200
        assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 200  # a weight load takes a while
        time.sleep(1.3)
        assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 503
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # alive: only generation is stuck
        assert httpx.post(f"{url}/continue_generation", json={}, timeout=10).status_code == 200
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    finally:
        if backend != "sim":
            engine.process.stop()
