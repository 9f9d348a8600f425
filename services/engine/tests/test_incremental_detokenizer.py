"""A streamed job's text, decoded incrementally, is exactly the whole decode's at every output, for every kind of
tokenizer the engine serves (built here with the `tokenizers` library), and a long stream decodes O(N) tokens."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlfleet.char_tokenizer import save_char_tokenizer
from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.incremental_detokenizer import decoding_locality
from rlfleet_engine.sampling_params import SamplingParams
from rlfleet_engine.sim_backend import SimTokenizer
from rlfleet_engine.stop_conditions import FinishReason, token_finish

CORPUS = [f"The quick brown fox, déjà vu: 中文 isn't {i} . ok? naïve 😀 don't !" for i in range(60)]
WORDS = ["the", "quick", "fox", "déjà", "vu", "中", "文", "n't", "'s", "😀", ".", ",", "?", "a", "b"]


def _fast(core: Tokenizer, **kwargs: Any) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=core, **kwargs)


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 / Qwen style: bytes as characters, merges, special tokens and an added (not special) token."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    special = ["<|endoftext|>", "<|im_end|>"]
    core.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=320, initial_alphabet=alphabet, special_tokens=special)
    )
    core.add_tokens(["<tool>"])
    return _fast(core, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def unigram_metaspace(cleanup: bool) -> PreTrainedTokenizerFast:
    """SentencePiece (T5) style: pieces with a leading "▁" for a space, dropped at the start of the text."""
    pieces = ["<unk>", "<s>", "</s>", "▁", *(f"▁{w}" for w in WORDS), *WORDS, "é", "à", "x"]
    core = Tokenizer(models.Unigram([(piece, -float(i % 7) - 1) for i, piece in enumerate(pieces)], unk_id=0))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    core.add_special_tokens(["<s>", "</s>"])
    return _fast(core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=cleanup)


def sentencepiece_byte_fallback() -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral style: BPE pieces, characters outside the vocabulary as byte tokens <0x..>."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *(f"▁{w}" for w in WORDS), *WORDS]
    core = Tokenizer(models.BPE({p: i for i, p in enumerate(dict.fromkeys(pieces))}, [], byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    core.add_special_tokens(["<s>", "</s>"])
    return _fast(core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False)


def wordpiece(cleanup: bool) -> PreTrainedTokenizerFast:
    """BERT style: tokens joined by spaces, "##" continuing a word."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS, "'", "n", "t", "##s", "##x", "##中", "##'t"]
    core = Tokenizer(models.WordPiece({p: i for i, p in enumerate(dict.fromkeys(vocab))}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    core.add_special_tokens(["[PAD]", "[CLS]", "[SEP]"])
    return _fast(core, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", clean_up_tokenization_spaces=cleanup)


def char_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """The tiny model's own tokenizer."""
    save_char_tokenizer(out, model_max_length=512)
    return PreTrainedTokenizerFast.from_pretrained(out)


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {
        "byte-level-bpe": byte_level_bpe(),
        "unigram-metaspace": unigram_metaspace(cleanup=False),
        "unigram-metaspace-cleanup": unigram_metaspace(cleanup=True),
        "sentencepiece-byte-fallback": sentencepiece_byte_fallback(),
        "wordpiece": wordpiece(cleanup=False),
        "wordpiece-cleanup": wordpiece(cleanup=True),
        "char": char_tokenizer(tmp_path_factory.mktemp("char-tokenizer")),
        "sim": SimTokenizer(),
    }


KINDS = [
    "byte-level-bpe",
    "unigram-metaspace",
    "unigram-metaspace-cleanup",
    "sentencepiece-byte-fallback",
    "wordpiece",
    "wordpiece-cleanup",
    "char",
    "sim",
]
FULL_DECODE_ONLY = {"unigram-metaspace-cleanup", "wordpiece-cleanup"}


class WholeDecode:
    """The tokenizer as the old code used it: no decoder to inspect, so every text is decoded whole."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def random_ids(tokenizer: Any, rng: random.Random, count: int, well_formed: bool) -> list[int]:
    """`count` ids, special tokens among them. Well formed: byte tokens <0x..> only as whole UTF-8 characters, each
    followed by another token. Byte tokens in a row decode as one group, all U+FFFD while its last character lacks
    bytes: a stray byte changes the text of those before it, and so does a character that is still incomplete,
    even for the whole decode, whose held-back text then shrinks."""
    if isinstance(tokenizer, SimTokenizer):
        return [rng.choice([*range(97, 123), 32, 0xE9, 0x4E2D, 0xD800]) for _ in range(count)]
    specials = list(tokenizer.all_special_ids)
    bytes_at = tokenizer.convert_tokens_to_ids("<0x00>") if "<0x00>" in tokenizer.get_vocab() else None
    if well_formed and bytes_at is not None:
        pieces = [i for i in range(len(tokenizer)) if not bytes_at <= i < bytes_at + 256 and i not in specials]
    else:
        pieces = list(range(len(tokenizer)))
    ids: list[int] = []
    while len(ids) < count:
        if rng.random() < 0.15:
            ids.append(rng.choice(specials))
        elif well_formed and bytes_at is not None and rng.random() < 0.3:
            ids.extend(bytes_at + b for b in rng.choice("é中😀x").encode())
            ids.append(rng.choice(pieces))
        else:
            ids.append(rng.choice(pieces))
    return ids[:count]


def stream(job: GenerationJob, tokenizer: Any, ids: Sequence[int], chunks: Sequence[int]) -> list[str]:
    """The text of each output a streamed job publishes, sampling `ids` and publishing after each of `chunks` tokens,
    checking the stop conditions at every token as the scheduler does; the last output is the finished job's."""
    texts, pending = [], list(chunks)
    for token in ids:
        job.append(token, -1.0, [], "0")
        reason = token_finish(job.output_ids, job.params, ()) or job.check_stop_strings(tokenizer)
        if reason is not None:
            job.finish_with(reason)
        pending[0] -= 1
        if reason is not None or pending[0] == 0:
            texts.append(job.text(tokenizer))
            pending = pending[1:] or [1]
        if reason is not None:
            break
    if job.finish is None:
        job.finish_with(FinishReason("length", length=len(ids)))
        texts.append(job.text(tokenizer))
    return texts


def new_job(**params: Any) -> GenerationJob:
    return GenerationJob(rid="r", input_ids=[1], params=SamplingParams(**params), deliver=lambda out: None, stream=True)


def random_chunks(rng: random.Random, count: int) -> list[int]:
    return [rng.choice([1, 1, 1, 2, 3, 5, 8]) for _ in range(count)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("kind", sorted(set(KINDS) - FULL_DECODE_ONLY))
def test_streamed_deltas_add_up_to_the_whole_decode(
    tokenizers_by_kind: dict[str, Any], kind: str, skip_special_tokens: bool
) -> None:
    """Not with clean-up in effect: it rewrites across tokens ("a" "'s" -> "a's" only once "s" comes), so there even
    the whole decode of a shorter output is no prefix of the longer one's (those are decoded whole, see below)."""
    tokenizer = tokenizers_by_kind[kind]
    for seed in range(25):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randrange(1, 120), well_formed=True)
        params = {"max_new_tokens": 1000, "skip_special_tokens": skip_special_tokens}
        texts = stream(new_job(**params), tokenizer, ids, random_chunks(rng, len(ids)))
        final = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        deltas = [text[len(before) :] for before, text in zip(["", *texts], texts, strict=False)]
        assert texts[-1] == final and "".join(deltas) == final, (seed, ids)
        assert all(final.startswith(text) for text in texts), (seed, ids, texts)


@pytest.mark.parametrize("kind", KINDS)
def test_every_streamed_text_is_the_whole_decodes_with_stop_strings_and_stray_bytes(
    tokenizers_by_kind: dict[str, Any], kind: str
) -> None:
    """Any ids at all (bytes that never make a character included), stop strings cut across chunks, with and
    without special tokens and no_stop_trim: each published text is the one decoding the whole output gives."""
    tokenizer = tokenizers_by_kind[kind]
    for seed in range(40):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randrange(1, 100), well_formed=False)
        whole = tokenizer.decode(ids, skip_special_tokens=False)
        start = rng.randrange(len(whole) or 1)
        stops = [whole[start : start + rng.randint(1, 4)] or "q", rng.choice(["<s>", "</s>", "[SEP]", "x y"])]
        params = {
            "max_new_tokens": 1000,
            "stop": stops if seed % 4 else None,
            "skip_special_tokens": bool(seed % 2),
            "no_stop_trim": seed % 3 == 0,
            "ignore_eos": True,
        }
        chunks = random_chunks(rng, len(ids))
        expected = stream(new_job(**params), WholeDecode(tokenizer), ids, chunks)
        assert stream(new_job(**params), tokenizer, ids, chunks) == expected, (seed, ids, params)


def test_the_tokenizers_decoded_incrementally_and_those_decoded_whole(tokenizers_by_kind: dict[str, Any]) -> None:
    local = {kind for kind, tokenizer in tokenizers_by_kind.items() if decoding_locality(tokenizer) is not None}
    assert local == set(KINDS) - FULL_DECODE_ONLY
    ctc = wordpiece(cleanup=False)
    ctc.backend_tokenizer.decoder = decoders.CTC()  # merges repeated tokens: a token's text depends on the next
    assert decoding_locality(ctc) is None
    assert decoding_locality(WholeDecode(ctc)) is None


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
