"""/pause_generation is a barrier on both CPU engines: once it answers, no step is in flight and none runs until
/continue_generation, so no token comes out after the pause, and none is labelled with a version loaded during it.

In process: the `sim` core, and the model core over a backend whose decode step takes long enough to pause in.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry
from zero_logits_backend import CharTokenizer, ZeroLogitsBackend

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.engine_core import EngineCore
from rlfleet_engine.schemas import GenerateRequest, UpdateWeightsFromDiskRequest
from rlfleet_engine.sim_backend import SimEngineCore


def long_request(rid: str, max_new_tokens: int) -> GenerateRequest:
    return GenerateRequest.model_validate(
        {"input_ids": [1, 2, 3], "rid": rid, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    )


def test_the_model_core_answers_a_pause_only_once_the_step_in_flight_has_ended() -> None:
    backend = ZeroLogitsBackend(step_secs=0.3)
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
