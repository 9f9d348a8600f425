"""Tokenizers of every kind the engine serves, built with the `tokenizers` library (no download), and random ids
for them: byte tokens forming valid and invalid UTF-8, special tokens, added tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlfleet.char_tokenizer import save_char_tokenizer
from rlfleet_engine.sim_backend import SimTokenizer

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


def tokenizers_by_kind(char_dir: Path) -> dict[str, Any]:
    return {
        "byte-level-bpe": byte_level_bpe(),
        "unigram-metaspace": unigram_metaspace(cleanup=False),
        "unigram-metaspace-cleanup": unigram_metaspace(cleanup=True),
        "sentencepiece-byte-fallback": sentencepiece_byte_fallback(),
        "wordpiece": wordpiece(cleanup=False),
        "wordpiece-cleanup": wordpiece(cleanup=True),
        "char": char_tokenizer(char_dir),
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


class WholeDecode:
    """A tokenizer whose decoder cannot be inspected: only its whole decode is known, so a running job with it
    publishes no text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def random_ids(tokenizer: Any, rng: random.Random, count: int, well_formed: bool) -> list[int]:
    """`count` ids, special tokens among them, byte tokens <0x..> among them as whole UTF-8 characters. Well formed:
    only so, each character followed by a token of another kind; otherwise stray bytes too, which may join a
    character's group (with ByteFallback, bytes in a row decode as one group, all U+FFFD when invalid)."""
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
        elif bytes_at is not None and rng.random() < 0.3:
            ids.extend(bytes_at + b for b in rng.choice("é中😀x").encode())
            ids.append(rng.choice(pieces))
        else:
            ids.append(rng.choice(pieces))
    return ids[:count]


def plain_word(tokenizer: Any) -> list[int]:
    """The ids of " quick", ending in a token that decodes to letters (the byte-fallback BPE has no merges: it would
    spell a word in bytes, so its piece is taken whole)."""
    if isinstance(tokenizer, SimTokenizer):
        return tokenizer.encode(" quick")
    if "▁quick" in tokenizer.get_vocab():
        return [tokenizer.convert_tokens_to_ids("▁quick")]
    return list(tokenizer.encode(" quick", add_special_tokens=False))
