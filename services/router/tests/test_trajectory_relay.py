"""Trajectory turns whose answers the router relays in pieces (no Content-Length), read with a fake engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from router_fakes import RunningRouter, ThreadedServer

from rlfleet_router import engine_response

HEADER = {"X-Rlfleet-Trajectory-Id": "conv"}
CAPTURE_CAP = 4096  # stands in for the 32 MiB cap, so an answer over it costs kilobytes


def trajectory_engine() -> FastAPI:
    """/generate answers 3 tokens (logprob -0.5 each) as a chunked JSON body, `pad` characters of filler in it."""
    app = FastAPI()

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> dict[str, object]:
        return {}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, object]:
        return {"model_path": "/m", "weight_version": "0", "is_generation": True}

    @app.post("/generate")
    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        out = [100 + len(body["input_ids"]) + k for k in range(3)]
        meta = {"id": body["rid"], "weight_version": "0", "output_token_logprobs": [[-0.5, t, None] for t in out]}
        data = json.dumps({"output_ids": out, "meta_info": meta, "pad": "x" * body["pad"]}).encode()

        async def pieces() -> AsyncIterator[bytes]:  # a streamed body: relayed chunked, without a length
            for i in range(0, len(data), 1024):
                yield data[i : i + 1024]

        return StreamingResponse(pieces(), media_type="application/json")

    return app


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = ThreadedServer(trajectory_engine()).start()
    yield server.url
    server.stop()


def run_turns(router: RunningRouter, pads: list[int]) -> None:
    """Sends one turn per pad, each prompt the previous prompt + output + two tool tokens."""
    ids = [1, 2, 3, 4, 5]
    for k, pad in enumerate(pads):
        body = {"input_ids": ids, "return_logprob": True, "rid": f"t{k}", "pad": pad}
        answer = router.client.post("/generate", json=body, headers=HEADER)
        assert answer.status_code == 200, answer.text
        ids = ids + answer.json()["output_ids"] + [7, 7]


def test_a_pieced_answer_within_the_capture_cap_is_recorded(
    engine_url: str, start_router: Callable[..., RunningRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_response, "MAX_CAPTURED_BYTES", CAPTURE_CAP)
    router = start_router([engine_url])
    router.wait_healthy(1)
    run_turns(router, [0, 2000, 0])
    got = router.client.get("/trajectories/conv")
    assert got.status_code == 200, got.text
    assert got.json()["loss_mask"] == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert got.json()["response_logprobs"] == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3


def test_a_turn_whose_answer_is_over_the_capture_cap_makes_the_trajectory_a_conflict(
    engine_url: str, start_router: Callable[..., RunningRouter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the oversized answer was relayed but its turn neither recorded nor marked lost: the next turn
    laid the model's own tokens out as between tokens (mask 0, logprob 0.0), and GET answered 200."""
    monkeypatch.setattr(engine_response, "MAX_CAPTURED_BYTES", CAPTURE_CAP)
    router = start_router([engine_url])
    router.wait_healthy(1)
    run_turns(router, [0, 2 * CAPTURE_CAP, 0])
    got = router.client.get("/trajectories/conv")
    assert got.status_code == 409, got.text
    message = got.json()["error"]["message"]
    assert f"turn 2 (rid 't1') ran on {engine_url}" in message and "over" in message, message
