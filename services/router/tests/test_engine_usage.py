"""Reading prompt and cached tokens from engine answers as they are relayed (plain JSON, batches, SSE)."""

from __future__ import annotations

import json

from rlfleet_router.engine_usage import UsageTap, usage_of


def meta(prompt: int, cached: int, finished: bool = True) -> dict[str, object]:
    reason = {"type": "length", "length": 4} if finished else None
    return {"text": "x", "meta_info": {"prompt_tokens": prompt, "cached_tokens": cached, "finish_reason": reason}}


def test_plain_answers_and_batches_in_pieces() -> None:
    tap = UsageTap("application/json")
    raw = json.dumps([meta(10, 8), meta(12, 0)]).encode()
    for i in range(0, len(raw), 7):
        tap.feed(raw[i : i + 7])
    usage = tap.result()
    assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (22, 8)


def test_streams_count_only_finished_events() -> None:
    tap = UsageTap("text/event-stream")
    events = [meta(10, 4, finished=False), meta(10, 4), {**meta(30, 16), "index": 1}]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for i in range(0, len(raw), 5):
        tap.feed(raw[i : i + 5])
    usage = tap.result()
    assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (40, 20)


def test_openai_usage_and_answers_without_usage() -> None:
    answer = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}}
    assert usage_of(answer).cached_tokens == 3
    tap = UsageTap("application/json")
    tap.feed(b'{"error": "engine fault"}')
    assert tap.result() is None


def openai_chunk(choices: list[dict[str, object]], usage: dict[str, object] | None) -> bytes:
    event = {"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def test_openai_streams_count_their_usage_chunk_once() -> None:
    # stream_options.include_usage with continuous_usage_stats: a running count on every choice, the total last.
    running: dict[str, object] = {"prompt_tokens": 9, "completion_tokens": 1}
    total: dict[str, object] = {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    raw = (
        openai_chunk([{"index": 0, "text": "a", "finish_reason": None}], running)
        + openai_chunk([{"index": 0, "text": "b", "finish_reason": "length"}], {**running, "completion_tokens": 2})
        + openai_chunk([], total)
        + b"data: [DONE]\n\n"
    )
    tap = UsageTap("text/event-stream")
    for i in range(0, len(raw), 6):
        tap.feed(raw[i : i + 6])
    usage = tap.result()
    assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (9, 4)


def test_openai_streams_without_a_usage_chunk_report_nothing() -> None:
    tap = UsageTap("text/event-stream")
    tap.feed(openai_chunk([{"index": 0, "text": "a", "finish_reason": "stop"}], None) + b"data: [DONE]\n\n")
    assert tap.result() is None
