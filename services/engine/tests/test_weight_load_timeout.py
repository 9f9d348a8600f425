"""A weight load that outlives its bound (WEIGHT_LOAD_TIMEOUT_S, shortened here): a started load runs to its end
and the answer says it is still in progress, a load that never started never runs, and the running batch is
never failed by either (in process, on the tiny model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

import rlfleet_engine.engine_core as engine_core
from rlfleet.errors import DeadlineExceeded
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.http_app import create_app
from rlfleet_engine.schemas import GenerateRequest
from rlfleet_engine.sim_backend import SimEngineCore
from rlfleet_engine.transformers_backend import TransformersBackend

LONG = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def core(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[engine_core.EngineCore]:
    monkeypatch.setattr(engine_core, "WEIGHT_LOAD_TIMEOUT_S", 0.3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = str(tiny_model_dir)
    config = EngineConfig(model_path=model, weight_version="0")
    running = engine_core.EngineCore(
        config, TransformersBackend(model), AutoTokenizer.from_pretrained(model), CollectorRegistry()
    )
    running.start()
    yield running
    running.stop()
    torch.set_num_threads(threads)


def slow_load(seconds: float, ran: list[float]) -> Any:
    def load(backend: Any) -> None:
        ran.append(time.monotonic())
        time.sleep(seconds)

    return load


def test_a_started_load_that_outlives_its_bound_is_applied_and_the_batch_goes_on(core: engine_core.EngineCore) -> None:
    async def scenario() -> tuple[str, dict[str, Any]]:
        generation = asyncio.create_task(core.generate(GenerateRequest(input_ids=[20, 21, 22], sampling_params=LONG)))
        await asyncio.sleep(0.3)  # decoding
        with pytest.raises(DeadlineExceeded) as failed:
            await core._load(slow_load(1.0, []), "7", "a slow source")
        out = await generation
        assert isinstance(out, dict)
        return str(failed.value), out

    message, out = asyncio.run(scenario())
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == LONG["max_new_tokens"]
    spans = out["meta_info"]["weight_versions"]  # held through the load, not failed by it
    assert [span["version"] for span in spans] == ["0", "7"] and spans[-1]["end"] == LONG["max_new_tokens"]
    assert core.scheduler.weight_version == "7"
    assert "still in progress" in message and "nothing was loaded" not in message


def test_a_load_that_could_not_start_within_its_bound_never_runs(core: engine_core.EngineCore) -> None:
    ran: list[float] = []

    async def scenario() -> str:
        first = asyncio.create_task(core._load(slow_load(1.0, ran), "7", "a slow source"))
        await asyncio.sleep(0.05)  # the first load holds the scheduler thread now
        with pytest.raises(DeadlineExceeded) as failed:
            await core._load(slow_load(0.0, ran), "8", "a queued source")
        with pytest.raises(DeadlineExceeded):
            await first
        await asyncio.sleep(1.2)  # past the first load's end: the second would have run by now
        return str(failed.value)

    message = asyncio.run(scenario())
    assert "did not start" in message and "nothing was loaded" in message
    assert len(ran) == 1 and core.scheduler.weight_version == "7"


def test_a_disk_load_past_its_bound_answers_504_in_the_weight_load_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    sim = SimEngineCore(EngineConfig(model_path="sim"), registry)

    async def outlived(req: Any) -> dict[str, Any]:
        raise DeadlineExceeded("loading weights from /w took over 300s and is still in progress")

    monkeypatch.setattr(sim, "update_weights_from_disk", outlived)
    with TestClient(create_app(sim, registry)) as client:  # type: ignore[arg-type]
        answer = client.post("/update_weights_from_disk", json={"model_path": "/w"})
    assert answer.status_code == 504
    assert answer.json() == {
        "success": False,
        "message": "Failed to update weights: loading weights from /w took over 300s and is still in progress",
        "num_paused_requests": 0,
    }
