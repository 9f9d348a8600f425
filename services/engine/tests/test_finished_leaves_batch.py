"""A request's answer reaches its client only once the request has left the running batch: a client that has its
whole answer and asks /flush_cache at once (as an RL step does before loading weights) is not refused for
"pending requests" by its own finished request, however slow the scheduler thread is to come back.

In process: the model core over a backend whose row release (after each finished request) takes long."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from zero_logits_backend import CharTokenizer, ZeroLogitsBackend

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.engine_core import EngineCore
from rlfleet_engine.schemas import GenerateRequest


class SlowRelease(ZeroLogitsBackend):
    def keep(self, rows: Sequence[int]) -> None:
        time.sleep(0.5)  # the scheduler thread held up between a request's last token and its leaving the batch


def test_a_finished_request_is_not_running_when_its_answer_arrives() -> None:
    core = EngineCore(EngineConfig(model_path="slow"), SlowRelease(), CharTokenizer(), CollectorRegistry())  # type: ignore[arg-type]
    core.start()
    request = GenerateRequest.model_validate(
        {"input_ids": [1, 2, 3], "rid": "r", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    )

    async def scenario() -> tuple[tuple[int, int], bool]:
        await core.generate(request)
        return core.scheduler.counts(), core.flush_cache()

    try:
        counts, flushed = asyncio.run(scenario())
    finally:
        core.stop()
    assert counts == (0, 0), "the answered request still counted as running"
    assert flushed, "/flush_cache refused for the request already answered"
