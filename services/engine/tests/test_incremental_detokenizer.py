"""The incremental decoder commits exactly the decode of the tokens before each of its points, and text every later
decode starts with, for every kind of tokenizer the engine serves; a long stream decodes O(N) tokens."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from job_streams import new_job, stream
from tokenizer_kinds import KINDS, WholeDecode, byte_level_bpe, plain_word, random_ids, unigram_metaspace, wordpiece
from tokenizers import decoders
from transformers import PreTrainedTokenizerFast

from rlfleet_engine.incremental_detokenizer import IncrementalDetokenizer, decoding_locality


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_each_point_commits_the_decode_that_every_later_decode_starts_with(
    tokenizers_by_kind: dict[str, Any], kind: str, skip_special_tokens: bool
) -> None:
    """And an output ending in a plain word has committed all of its text."""
    tokenizer = tokenizers_by_kind[kind]
    for seed in range(25):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randrange(1, 80), well_formed=seed % 2 == 0) + plain_word(tokenizer)
        decodes = [
            tokenizer.decode(ids[:count], skip_special_tokens=skip_special_tokens) for count in range(len(ids) + 1)
        ]
        decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        points = []
        for count in range(len(ids) + 1):
            point, text = decoder.committed(ids[:count], count)
            assert point <= count and text == decodes[point], (seed, ids, count)
            assert all(later.startswith(text) for later in decodes[count:]), (seed, ids, count)
            points.append(point)
        assert points == sorted(points) and points[-1] == len(ids), (seed, ids, points)


def test_the_tokenizers_decoded_incrementally_and_those_decoded_whole(tokenizers_by_kind: dict[str, Any]) -> None:
    localities = {kind: decoding_locality(tokenizer) for kind, tokenizer in tokenizers_by_kind.items()}
    cleaned_up = {kind for kind, locality in localities.items() if locality is not None and locality.clean_up}
    assert None not in localities.values() and cleaned_up == {"unigram-metaspace-cleanup", "wordpiece-cleanup"}
    ctc = wordpiece(cleanup=False)
    ctc.backend_tokenizer.decoder = decoders.CTC()  # merges repeated tokens: a token's text depends on the next
    assert decoding_locality(ctc) is None
    assert decoding_locality(WholeDecode(ctc)) is None
    own_clean_up = type("OwnCleanUp", (PreTrainedTokenizerFast,), {"clean_up_tokenization": lambda self, text: text})
    assert decoding_locality(own_clean_up(tokenizer_object=unigram_metaspace(cleanup=True).backend_tokenizer)) is None


def counting(tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    decoded = [0]
    decode = tokenizer.decode

    def counted(token_ids: Sequence[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        decoded[0] += len(token_ids)
        return str(decode(list(token_ids), skip_special_tokens=skip_special_tokens, **kwargs))

    monkeypatch.setattr(tokenizer, "decode", counted)
    return lambda: decoded[0]


@pytest.mark.parametrize("stop", [None, ["</answer>"]])
def test_a_long_stream_decodes_a_bounded_number_of_tokens_per_token(
    stop: list[str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4096 tokens published one by one: decoding the whole output at each decoded 8.4M tokens (17M with a stop
    string); now a few per token, plus the stop-string check's window of 4L + 1 tokens and the final decode."""
    tokenizer = byte_level_bpe()
    decoded = counting(tokenizer, monkeypatch)
    rng = random.Random(0)
    ids = [rng.randrange(300) for _ in range(4096)]
    texts = stream(new_job(max_new_tokens=len(ids), stop=stop), tokenizer, ids, [1] * len(ids))
    assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=True)
    window = 4 * max(len(s) for s in stop) + 1 if stop else 0
    assert decoded() < (12 + window) * len(ids), decoded()
