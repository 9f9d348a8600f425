"""What the `sim` backend's steps record in SGLang's latency metrics. Every figure comes from the simulation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.schemas import GenerateRequest, UpdateWeightsFromDiskRequest
from rlfleet_engine.sim_backend import SimEngineCore

TOKENS = 20


def test_requests_held_for_their_kv_to_be_recomputed_record_one_gap_per_token() -> None:
    """After a flushing load the held requests are prefilled again one at a time (the prefill budget): each
    iteration a request waited, it was counted a gap with no token, and each of those gaps again in the next."""

    async def scenario() -> CollectorRegistry:
        registry = CollectorRegistry()
        config = EngineConfig(
            model_path="sim", sim_decode_ms_per_step=1.0, sim_prefill_us_per_token=1.0, max_prefill_tokens=4096
        )
        core = SimEngineCore(config, registry)
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": TOKENS}}
        held = [
            asyncio.create_task(
                core.generate(
                    GenerateRequest.model_validate({**body, "input_ids": list(range(k * 10_000, k * 10_000 + 3000))})
                )
            )
            for k in range(4)
        ]
        deadline = time.monotonic() + 10
        while len(core.scheduler._running) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await core.pause("retract")
        load = UpdateWeightsFromDiskRequest(model_path="/ckpt/v1", weight_version="1")
        assert (await core.update_weights_from_disk(load))["num_paused_requests"] == 4
        core.resume()
        await asyncio.wait_for(asyncio.gather(*held), timeout=30)
        await core.scheduler.stop()
        return registry

    registry = asyncio.run(scenario())
    count = registry.get_sample_value("sglang:inter_token_latency_seconds_count", {"model_name": "sim"})
    assert count == 4 * (TOKENS - 1), "one gap per token after the first"
