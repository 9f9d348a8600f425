"""--max-prefill-tokens on the `transformers` core: each prefill (new requests, and the running rows' KV recomputed
after a weight load) computes at most that many tokens, counted as the backend pays them (distinct prompts x the
longest, rows being padded to it; the `n` samples of a prompt once), the first request always; the rest wait in
order. In process, over a backend that records its prefills, and on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer
from zero_logits_backend import CharTokenizer, ZeroLogitsBackend

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.engine_core import EngineCore
from rlfleet_engine.prefill_budget import PrefillBatch, prefill_batches
from rlfleet_engine.schemas import GenerateRequest
from rlfleet_engine.transformers_backend import TransformersBackend

BUDGET = 100


def cost(prompts: Sequence[Sequence[int]]) -> int:
    """What the transformers backend computes to prefill `prompts` together."""
    return len({tuple(p) for p in prompts}) * max(len(p) for p in prompts)


def run(core: EngineCore, body: dict[str, Any]) -> Any:
    core.start()
    try:
        return asyncio.run(core.generate(GenerateRequest.model_validate(body)))
    finally:
        core.stop()


def recording_core(backend: ZeroLogitsBackend, **config: Any) -> EngineCore:
    settings = EngineConfig(model_path="recording", max_prefill_tokens=BUDGET, **config)
    return EngineCore(settings, backend, CharTokenizer(), CollectorRegistry())  # type: ignore[arg-type]


def test_a_prefill_batch_costs_distinct_prompts_times_the_longest() -> None:
    batch = PrefillBatch(BUDGET)
    assert batch.take([1] * 30) and batch.take([2] * 20) and batch.take([1] * 30)  # the same prompt again: free
    assert batch.tokens == 60
    assert not batch.take([3] * 40)  # 3 x 40 > 100, though 30 + 20 + 40 fits
    assert batch.take([4] * 30) and batch.tokens == 90
    alone = PrefillBatch(BUDGET)
    assert alone.take([5] * 300) and alone.tokens == 300  # over the budget, but first
    assert not alone.take([6])
    prompts = [[1] * 10, [2] * 10, [3] * 80, [4] * 10, [5] * 300, [6] * 10]
    assert list(prefill_batches(prompts, BUDGET)) == [
        prompts[:2],
        [prompts[2]],
        [prompts[3]],
        [prompts[4]],
        [prompts[5]],
    ]


def test_requests_are_prefilled_within_the_budget_in_order() -> None:
    backend = ZeroLogitsBackend()
    short = [[k] * 10 for k in (1, 2, 3)]
    long, after, huge, last = [4] * 80, [5] * 10, [6] * 150, [7] * 10
    prompts = [*short, long, after, huge, last]
    out = run(
        recording_core(backend),
        {"input_ids": prompts, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    )
    assert [len(o["output_ids"]) for o in out] == [2] * len(prompts)
    # All seven arrived together; the old scheduler prefilled them in one batch of 7 x 150 tokens. The long prompt
    # is not passed by the short one behind it, and the one over the budget runs alone.
    expected = [short, [long], [after], [huge], [last]]
    assert backend.prefills == [[tuple(p) for p in batch] for batch in expected]


def test_the_samples_of_a_prompt_count_once() -> None:
    backend = ZeroLogitsBackend()
    prompt, other = [1] * 90, [2] * 20
    run(
        recording_core(backend),
        {"input_ids": [prompt, other], "sampling_params": {"max_new_tokens": 1, "temperature": 0, "n": 4}},
    )
    # 4 rows of 90 tokens are one prompt computed once (90 tokens); the next prompt would make it 2 x 90.
    assert backend.prefills == [[tuple(prompt)] * 4, [tuple(other)] * 4]


def test_the_kv_recomputed_after_a_weight_load_is_prefilled_within_the_budget() -> None:
    backend = ZeroLogitsBackend(step_secs=0.002)
    core = recording_core(backend)
    prompts = [[k] * 30 for k in range(1, 5)]
    core.start()

    async def scenario() -> list[list[int]]:
        generation = asyncio.create_task(
            core.generate(
                GenerateRequest.model_validate(
                    {"input_ids": prompts, "rid": "r", "sampling_params": {"max_new_tokens": 400, "temperature": 0}}
                )
            )
        )
        while core.scheduler.counts()[0] < len(prompts):
            await asyncio.sleep(0.01)
        await core.pause("retract")  # so the sequences below are those the load recomputes
        sequences = [[*job.input_ids, *job.output_ids[:-1]] for job in core.scheduler._running]
        before = len(backend.prefills)
        assert await core._load(lambda _: None, "1", "a test") == len(prompts)
        recomputed = backend.prefills[before:]
        core.abort("r")
        core.resume()
        await generation
        assert [list(row) for batch in recomputed for row in batch] == sequences
        assert len(recomputed) > 1 and all(cost(batch) <= BUDGET for batch in recomputed)
        return sequences

    try:
        sequences = asyncio.run(scenario())
    finally:
        core.stop()
    assert cost(sequences) > BUDGET  # all at once would have been over it


@pytest.mark.parametrize("budget", [1, 40])
def test_a_small_budget_changes_no_token(tiny_model_dir: Path, budget: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = str(tiny_model_dir)
    prompts = [list(range(3, 3 + k)) for k in (5, 30, 8, 50, 3)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2}}

    def outputs(max_prefill_tokens: int) -> list[list[int]]:
        config = EngineConfig(model_path=model, max_prefill_tokens=max_prefill_tokens)
        core = EngineCore(config, TransformersBackend(model), AutoTokenizer.from_pretrained(model), CollectorRegistry())
        return [o["output_ids"] for o in run(core, body)]

    try:
        assert outputs(budget) == outputs(16384)
    finally:
        torch.set_num_threads(threads)
