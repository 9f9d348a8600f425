"""A streamed output's text only grows: each chunk's text is a prefix of every later one's and of the final text,
which is still the whole decode, for every kind of tokenizer the engine serves, so the deltas a client (or the
OpenAI routes) takes from the cumulative texts add up to the final text."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from job_streams import new_job, random_chunks, stream, stream_outputs
from tokenizer_kinds import KINDS, WholeDecode, random_ids, sentencepiece_byte_fallback, wordpiece

from rlfleet_engine.openai_api import OpenAIServer
from rlfleet_engine.openai_schemas import ChatCompletionRequest, CompletionRequest


def random_params(tokenizer: Any, ids: Sequence[int], rng: random.Random, seed: int) -> dict[str, Any]:
    """Stop strings cut from the output itself (so they match, across chunks) or special tokens' text, with and
    without special tokens and stop trimming."""
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    start = rng.randrange(len(whole) or 1)
    stops = [whole[start : start + rng.randint(1, 4)] or "q", rng.choice(["<s>", "</s>", "[SEP]", "x y", "a", " "])]
    return {
        "max_new_tokens": 1000,
        "stop": stops if seed % 4 else None,
        "skip_special_tokens": bool(seed % 2),
        "no_stop_trim": seed % 3 == 0,
        "ignore_eos": True,
    }


def assert_only_grows(texts: Sequence[str], context: object) -> None:
    for i, text in enumerate(texts):
        assert all(later.startswith(text) for later in texts[i + 1 :]), (context, i, texts)


@pytest.mark.parametrize("kind", KINDS)
def test_every_streamed_text_is_a_prefix_of_the_later_ones_and_the_final_text_is_the_whole_decode(
    tokenizers_by_kind: dict[str, Any], kind: str
) -> None:
    tokenizer = tokenizers_by_kind[kind]
    for seed in range(60):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randrange(1, 100), well_formed=seed % 5 == 0)
        params = random_params(tokenizer, ids, rng, seed)
        chunks = random_chunks(rng, len(ids))
        job = new_job(**params)
        texts = stream(job, tokenizer, ids, chunks)
        assert_only_grows(texts, (seed, ids, params))
        # Decoded whole at every step, as before: the same final text (stop strings trimmed alike).
        assert texts[-1] == stream(new_job(**params), WholeDecode(tokenizer), ids, chunks)[-1], (seed, ids, params)
        if not params["stop"] or params["no_stop_trim"]:
            skip = params["skip_special_tokens"]
            assert texts[-1] == tokenizer.decode(job.output_ids, skip_special_tokens=skip), (seed, ids, params)


async def _replay(outputs: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for out in outputs:
        yield out


def openai_deltas(outputs: list[dict[str, Any]], chat: bool) -> list[str]:
    """The text deltas the OpenAI route streams for these /generate outputs."""
    if chat:
        req: CompletionRequest | ChatCompletionRequest = ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], stream=True
        )
    else:
        req = CompletionRequest(prompt=[1], stream=True)

    async def collect() -> list[bytes]:
        server = OpenAIServer(core=None, chat_defaults={})  # type: ignore[arg-type]
        return [event async for event in server._events(req, [[1]], _replay(outputs))]

    choices = [json.loads(e[6:])["choices"] for e in asyncio.run(collect()) if e.startswith(b"data: {")]
    if chat:
        return [c[0]["delta"].get("content") or "" for c in choices if c]
    return [c[0]["text"] for c in choices if c]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_openai_stream_deltas_add_up_to_the_final_text(
    tokenizers_by_kind: dict[str, Any], kind: str, chat: bool
) -> None:
    tokenizer = tokenizers_by_kind[kind]
    for seed in range(20):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randrange(1, 80), well_formed=False)
        params = random_params(tokenizer, ids, rng, seed)
        outputs = stream_outputs(new_job(**params), tokenizer, ids, random_chunks(rng, len(ids)))
        assert "".join(openai_deltas(outputs, chat)) == outputs[-1]["text"], (seed, ids, params)


def test_a_byte_group_that_one_more_byte_makes_invalid_is_held_back_whole() -> None:
    """ByteFallback decodes bytes in a row as one group: "é" (C3 A9) becomes three U+FFFD when a lone C3 follows.
    Publishing the whole decode streamed "ab", "abé", "ab" and then "ab\ufffd\ufffd\ufffd b": a text that shrank,
    whose OpenAI deltas added up to "abé\ufffd\ufffd\ufffd b"."""
    tokenizer = sentencepiece_byte_fallback()
    vocab = tokenizer.get_vocab()
    ids = [vocab[token] for token in ["▁a", "b", "<0xC3>", "<0xA9>", "<0xC3>", "▁b"]]
    outputs = stream_outputs(new_job(max_new_tokens=100), tokenizer, ids, [1] * len(ids))
    final = "ab\ufffd\ufffd\ufffd b"
    assert [out["text"] for out in outputs] == ["a", "ab", "ab", "ab", "ab", final, final]
    assert openai_deltas(outputs, chat=False) == ["a", "b", "", "", "", "\ufffd\ufffd\ufffd b", ""]


def test_text_the_clean_up_may_still_rewrite_is_held_back() -> None:
    """With clean_up_tokenization_spaces, "a '" becomes "a'" once "n't" follows: the stream waited for it."""
    tokenizer = wordpiece(cleanup=True)
    ids = [tokenizer.get_vocab()[token] for token in ["a", "'", "n", "##'t", "?", "b"]]
    texts = stream(new_job(max_new_tokens=100), tokenizer, ids, [1] * len(ids))
    assert texts == ["a", "a", "a", "a'n't", "a'n't?", "a'n't? b", "a'n't? b"]


def test_a_tokenizer_whose_decode_is_not_known_to_be_local_publishes_text_only_when_finished(
    tokenizers_by_kind: dict[str, Any],
) -> None:
    tokenizer = tokenizers_by_kind["sentencepiece-byte-fallback"]
    ids = random_ids(tokenizer, random.Random(0), 30, well_formed=False)
    texts = stream(new_job(max_new_tokens=100), WholeDecode(tokenizer), ids, [3] * 10)
    assert texts[:-1] == [""] * (len(texts) - 1) and texts[-1] == tokenizer.decode(ids, skip_special_tokens=True)
