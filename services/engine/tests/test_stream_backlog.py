"""A stream whose reader falls behind: it reads each job's latest output, and the engine holds no backlog of chunks.

In process, on the `sim` backend (its outputs follow from the prompt, so a stream and a whole answer match).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.latest_outputs import LatestOutputs
from rlfleet_engine.schemas import GenerateRequest
from rlfleet_engine.sim_backend import SimEngineCore

BODY = {"text": "hello world", "sampling_params": {"max_new_tokens": 64, "n": 2}, "return_logprob": True}


def test_a_reader_that_falls_behind_reads_each_jobs_latest_output() -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), CollectorRegistry())
        try:
            chunks = core.generate_stream(GenerateRequest.model_validate({**BODY, "stream": True}))
            deadline = time.monotonic() + 10
            while any(job.finish is None for job in core.in_flight.values()):  # decoded, nothing read yet
                assert time.monotonic() < deadline, "the jobs did not finish"
                await asyncio.sleep(0.01)
            streamed = [chunk async for chunk in chunks]
            whole = await core.generate(GenerateRequest.model_validate(BODY))
        finally:
            await core.scheduler.stop()
        return streamed, whole if isinstance(whole, list) else [whole]

    streamed, whole = asyncio.run(run())
    # 64 chunks a job were delivered while nobody read: each later one holds all an earlier one did.
    assert len(streamed) == 2, [len(chunk["output_ids"]) for chunk in streamed]
    assert sorted(chunk["index"] for chunk in streamed) == [0, 1]
    for chunk in streamed:
        answer = whole[chunk["index"]]
        assert chunk["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
        assert chunk["output_ids"] == answer["output_ids"] and chunk["text"] == answer["text"]
        assert len(chunk["meta_info"]["output_token_logprobs"]) == 64


def test_outputs_come_in_the_order_their_jobs_were_last_heard_from() -> None:
    async def run() -> list[tuple[int, int]]:
        outputs = LatestOutputs()
        for n in range(1, 4):
            outputs.put_nowait((0, {"n": n}))
            outputs.put_nowait((1, {"n": n}))
        outputs.put_nowait((0, {"n": 4}))
        read = [await outputs.get() for _ in range(2)]
        waiting = asyncio.ensure_future(outputs.get())
        await asyncio.sleep(0.01)
        assert not waiting.done(), "nothing more was delivered"
        outputs.put_nowait((1, {"n": 5}))
        read.append(await asyncio.wait_for(waiting, 1))
        return [(index, out["n"]) for index, out in read]

    assert asyncio.run(run()) == [(1, 3), (0, 4), (1, 5)]
