"""Top logprobs on the `sim` backend: synthetic values in the shapes the `transformers` backend answers.

In process; every figure here comes from the simulation, not from a model.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from rlfleet_engine.config import EngineConfig
from rlfleet_engine.http_app import create_app
from rlfleet_engine.schemas import GenerateRequest
from rlfleet_engine.sim_backend import SimEngineCore


def sim_core() -> SimEngineCore:
    return SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), CollectorRegistry())


def generate(body: dict[str, Any]) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        core = sim_core()
        out = await core.generate(GenerateRequest.model_validate(body))
        await core.scheduler.stop()
        return out if isinstance(out, list) else [out]

    return asyncio.run(run())


def test_generate_returns_k_top_logprobs_per_position_holding_the_sampled_token() -> None:
    body = {
        "text": "hello world",
        "sampling_params": {"max_new_tokens": 6, "n": 2},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    outputs = generate(body)
    for out in outputs:
        meta = out["meta_info"]
        assert meta["input_top_logprobs"] == [None], "prompt logprobs are not computed (logprob_start_len -1)"
        tops = meta["output_top_logprobs"]
        assert len(tops) == len(out["output_ids"]) == 6
        for sampled, row in zip(meta["output_token_logprobs"], tops, strict=True):
            assert len(row) == 3 and len({token for _, token, _ in row}) == 3
            assert sampled in row, "the sampled token, with the logprob output_token_logprobs gives it"
            assert [lp for lp, _, _ in row] == sorted((lp for lp, _, _ in row), reverse=True)
            assert all(lp <= 0 and text == chr(token) for lp, token, text in row)
            assert sum(math.exp(lp) for lp, _, _ in row) <= 1 + 1e-9, "probabilities of one distribution"

    plain = generate({**body, "top_logprobs_num": 0, "return_text_in_logprobs": False})
    assert [o["output_ids"] for o in plain] == [o["output_ids"] for o in outputs], "asking for them changes nothing"
    assert [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in plain] == [
        [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outputs
    ]
    assert "output_top_logprobs" not in plain[0]["meta_info"]
    again = generate(body)
    assert [o["meta_info"]["output_top_logprobs"] for o in again] == [
        o["meta_info"]["output_top_logprobs"] for o in outputs
    ]


def test_the_openai_routes_answer_top_logprobs() -> None:
    registry = CollectorRegistry()
    core = SimEngineCore(EngineConfig(model_path="sim", sim_decode_ms_per_step=0.1), registry)
    with TestClient(create_app(core, registry)) as client:  # type: ignore[arg-type]
        chat = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
            },
        )
        assert chat.status_code == 200, chat.text
        content = chat.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            assert len(entry["top_logprobs"]) == 2
            sampled = [top for top in entry["top_logprobs"] if top["token"] == entry["token"]]
            assert len(sampled) == 1 and sampled[0]["logprob"] == entry["logprob"]

        completion = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})
        assert completion.status_code == 200, completion.text
        logprobs = completion.json()["choices"][0]["logprobs"]
        assert [len(row) for row in logprobs["top_logprobs"]] == [2, 2, 2]
        for token, logprob, row in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        ):
            assert row[token] == logprob
