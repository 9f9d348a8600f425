"""/pause_generation is a barrier on both CPU engines: once it answers, no step is in flight and none runs until
/continue_generation, so no token comes out after the pause, and none is labelled with a version loaded during it.

In process: the `sim` core, and the model core over a backend whose decode step takes long enough to pause in.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.engine_core import EngineCore
from rlfleet_engine.schemas import GenerateRequest, UpdateWeightsFromDiskRequest
from rlfleet_engine.sim_backend import SimEngineCore

VOCAB = 32


class SlowStepBackend:
    """Logits of zeros; each decode step takes `step_secs` and says when it starts."""

    vocab_size = VOCAB
    context_length = 512
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, step_secs: float) -> None:
        self.step_secs = step_secs
        self.stepping = threading.Event()

    def add(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.zeros((len(prompts), VOCAB))

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        self.stepping.set()
        time.sleep(self.step_secs)
        return torch.zeros((len(tokens), VOCAB))

    def keep(self, rows: Sequence[int]) -> None:
        pass

    def load_weights(self, model_path: str) -> None:
        pass

    def check_tensors(self, shapes: Sequence[tuple[str, tuple[int, ...]]], source: str) -> None:
        pass

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {}


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


def long_request(rid: str, max_new_tokens: int) -> GenerateRequest:
    return GenerateRequest.model_validate(
        {"input_ids": [1, 2, 3], "rid": rid, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    )


def test_the_model_core_answers_a_pause_only_once_the_step_in_flight_has_ended() -> None:
    backend = SlowStepBackend(step_secs=0.3)
    core = EngineCore(EngineConfig(model_path="slow"), backend, CharTokenizer(), CollectorRegistry())  # type: ignore[arg-type]
    core.start()

    async def scenario() -> tuple[int, int, list[str]]:
        generation = asyncio.create_task(core.generate(long_request("long", 4)))
        assert await asyncio.to_thread(backend.stepping.wait, 10), "a decode step started"
        await core.pause("retract")  # lands in the middle of that 0.3 s step
        job = core.in_flight["long"]
        at_pause = len(job.output_ids)
        await asyncio.sleep(0.6)
        after = len(job.output_ids)
        versions = list(job.weight_versions)
        core.resume()
        await generation
        return at_pause, after, versions

    try:
        at_pause, after, versions = asyncio.run(scenario())
    finally:
        core.stop()
    assert after == at_pause, "a token came out after the pause had answered"
    assert versions == ["default"]


def test_the_sim_answers_a_pause_only_once_the_iteration_in_flight_has_ended() -> None:
    async def scenario() -> tuple[int, int, list[str], dict[str, Any]]:
        core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=300.0), CollectorRegistry())
        generation = asyncio.create_task(core.generate(long_request("long", 3)))
        while "long" not in core.in_flight or not core.in_flight["long"].output_ids:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # inside the second iteration's 300 ms
        await core.pause("retract")
        job = core.in_flight["long"]
        at_pause = len(job.output_ids)
        await core.update_weights_from_disk(UpdateWeightsFromDiskRequest(model_path="/ckpt", weight_version="new"))
        await asyncio.sleep(0.5)
        after = len(job.output_ids)
        versions_while_paused = list(job.weight_versions)
        core.resume()
        out = await generation
        await core.scheduler.stop()
        assert isinstance(out, dict)
        return at_pause, after, versions_while_paused, out

    at_pause, after, versions, out = asyncio.run(scenario())
    assert after == at_pause == 2, "the token of the iteration under way came out before the pause answered"
    assert versions == ["default"], "no token of the old weights' iteration is labelled with the new version"
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "new", "start": 2, "end": 3}]
    assert out["meta_info"]["weight_versions"] == spans and len(out["output_ids"]) == 3
