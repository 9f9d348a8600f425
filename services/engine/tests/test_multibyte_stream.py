"""Streams of a byte-level tokenizer, whose tokens split characters: no chunk shows a character still missing bytes,
so each streamed text is a prefix of the final one and the OpenAI deltas add up to it."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_test_support import RunningEngine, start_engine

pytestmark = pytest.mark.e2e

ANSWER = "é中z"  # what the model answers to "a", greedily: 2-, 3- and 1-byte characters, then eos
EOS, PAD = 256, 257


def create_byte_model(out: Path) -> None:
    """A one-layer Llama over byte tokens (0-255) that continues "a" with the bytes of ANSWER, then eos."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(_bytes_to_unicode())} | {"<eos>": EOS, "<pad>": PAD}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>", "<pad>"])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>").save_pretrained(out)

    size = PAD + 1
    config = LlamaConfig(
        vocab_size=size,
        hidden_size=size + 6,  # one embedding dimension per token (and divisible by the heads)
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    model = LlamaForCausalLM(config)
    chain = [ord("a"), *ANSWER.encode(), EOS]
    with torch.no_grad():
        # The layer adds nothing (zero output projections): the logits are lm_head of the (normed) one-hot.
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :size] = torch.eye(size)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(size, size + 6)
        head[EOS, :size] = 10.0  # every token not in the chain is followed by eos
        for token, following in itertools.pairwise(chain):
            head[EOS, token] = 0.0
            head[following, token] = 10.0
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    model.save_pretrained(out)


def _bytes_to_unicode() -> list[str]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's table)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unprintable = [byte for byte in range(256) if byte not in printable]
    return [chr(byte) if byte in printable else chr(256 + unprintable.index(byte)) for byte in range(256)]


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    model_dir = tmp_path_factory.mktemp("byte-model")
    create_byte_model(model_dir)
    running = start_engine(model_dir, tmp_path_factory.mktemp("byte-engine-logs"))
    yield running
    running.process.stop()


def _events(engine: RunningEngine, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", engine.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_the_byte_model_answers_with_multibyte_characters(byte_engine: RunningEngine) -> None:
    out = byte_engine.generate({"text": "a", "sampling_params": {"temperature": 0}})
    assert out["text"] == ANSWER and out["output_ids"] == [*ANSWER.encode(), EOS]


@pytest.mark.parametrize(("stop", "final"), [(None, ANSWER), ("z", "é中"), ("中z", "é")])
def test_every_streamed_text_is_a_prefix_of_the_final_one(
    byte_engine: RunningEngine, stop: str | None, final: str
) -> None:
    body = {"text": "a", "stream": True, "sampling_params": {"temperature": 0, "stop": stop}}
    texts = [chunk["text"] for chunk in _events(byte_engine, "/generate", body)]
    assert texts[-1] == final
    assert all(final.startswith(text) for text in texts), texts


def test_openai_stream_deltas_add_up_to_the_text(byte_engine: RunningEngine) -> None:
    body = {"model": "m", "prompt": "a", "temperature": 0, "max_tokens": 10, "stream": True}
    deltas = [event["choices"][0]["text"] for event in _events(byte_engine, "/v1/completions", body)]
    assert "".join(deltas) == ANSWER, deltas
