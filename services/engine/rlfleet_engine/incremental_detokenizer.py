"""The text of a growing output, decoded a few tokens at a time instead of whole at every streamed chunk.

A streamed job publishes its whole text after every token; decoding all of its tokens each time made a stream of
N tokens cost O(N^2) tokens of decoding. As SGLang's detokenizer, vLLM and TGI do, `IncrementalDetokenizer` decodes
only a window: from a prefix offset (tokens already published, kept as left context: a WordPiece joiner, a
Metaspace leading space or a byte-level character depends on the token before) to the newest token, and appends the
part of the window's text past the text of its context. The text up to the read offset is then final; a window whose
text ends in U+FFFD (the first bytes of a character whose last ones are still to come) moves nothing.

Unlike those, the result must be exactly `tokenizer.decode(ids[:count], ...)` for every count, since the job's text
and its held-back tail are defined by that decode. That holds when decoding is local: the text a token adds depends
only on itself and the tokens just before it. `decoding_locality` decides that from the tokenizer's decoder, and a
tokenizer it cannot vouch for gets the whole decode every time, as before:
  * local: a Hugging Face fast tokenizer whose decoder chain is made of ByteLevel, Metaspace, WordPiece, Fuse,
    single-character Replace, Strip of leading characters (Llama's), ByteFallback, or no decoder at all; and any
    tokenizer declaring `decodes_token_by_token` (the `sim` backend's, one character per token);
  * not local, whole decode: `clean_up_tokenization_spaces` in effect (it rewrites " ." to "." and the like across
    token boundaries, so even the whole decode of a shorter output is not a prefix of the longer one's), slow
    (Python) tokenizers (`spaces_between_special_tokens`, per-class decode rules), classes that override decode,
    and any other decoder (CTC merges repeated tokens, BPEDecoder's end-of-word suffix, a Replace or Strip acting
    across tokens after Fuse).
Two rules keep a window exact for the local ones: its context decodes to some text (a window starting at a
skipped special token would lose the Metaspace space or WordPiece joiner of the token after it), and with
ByteFallback it never starts right after a byte token (bytes decode as one group, all U+FFFD when invalid, so a
byte that arrives later can change the text of those before it). A window that still does not start with its
context's text (a decoder behaving otherwise than described) switches the sequence to the whole decode.
Tokens that decode to nothing (skipped special tokens) or to an unfinished character widen the window until a token
with text ends it, as in SGLang.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# What a decoder gives for bytes that are not (yet) a whole UTF-8 character.
INCOMPLETE = "\ufffd"

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Text whose decode shows whether `clean_up_tokenization_spaces` is applied: it holds every pattern the clean-up
# rewrites ("a ." becomes "a." when it is).
_CLEANUP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're"
_CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class Locality:
    """How a tokenizer's decode may be done a window at a time (see the module docstring)."""

    id_to_token: Callable[[int], str | None] | None = None
    """With ByteFallback, the token string of an id, to tell byte tokens (`<0x..>`, decoded as one group: a window
    must not start right after one); None otherwise."""


def decoding_locality(tokenizer: object) -> Locality | None:
    """How `tokenizer` decodes locally, or None when only the whole decode is exact."""
    if getattr(tokenizer, "decodes_token_by_token", False):
        return Locality()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _decodes_as_the_fast_base(tokenizer) or _cleans_up(tokenizer, backend):
        return None
    stages = [] if backend.decoder is None else _flatten(json.loads(backend.decoder.__getstate__()))
    fused = byte_fallback = False
    for stage in stages:
        kind = stage.get("type")
        if kind in ("ByteLevel", "Fuse"):
            fused = True  # both hand the next stage one string
        elif kind in ("Metaspace", "WordPiece") and not fused:
            pass  # per token; only the first token of a window is decoded otherwise (without its space or joiner)
        elif kind == "Replace" and set(stage["pattern"]) == {"String"}:
            if fused and len(stage["pattern"]["String"]) > 1:
                return None
        elif kind == "ByteFallback" and not fused:
            byte_fallback = True
        elif not (kind == "Strip" and stage.get("stop") == 0):
            return None
    return Locality(backend.id_to_token if byte_fallback else None)


def _flatten(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        return [stage for inner in decoder["decoders"] for stage in _flatten(inner)]
    return [decoder]


def _decodes_as_the_fast_base(tokenizer: object) -> bool:
    """True if `decode` is the backend's decode plus the clean-up, as the fast tokenizers' base class has it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode
        and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
    )


def _cleans_up(tokenizer: Any, backend: Any) -> bool:
    """Whether decode applies `clean_up_tokenization_spaces` (transformers 5 ignores it for BPE models); True when
    the probe cannot tell (its raw decode shows none of the patterns)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    ids = backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
    raw = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    return not any(p in raw for p in _CLEANUP_PATTERNS) or tokenizer.decode(ids) != raw


class IncrementalDetokenizer:
    """`tokenizer.decode(ids[:count], skip_special_tokens)` of one growing sequence, for every count, at the cost
    of a few small decodes per token (see the module docstring for how, and for which tokenizers).

    The text of each length is kept as (length of the final text it starts with, the rest), so a shorter
    prefix (where a stop string may begin) costs no decode either."""

    def __init__(self, tokenizer: Detokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._locality = decoding_locality(tokenizer)
        self._prefix = 0
        """Start of the window: tokens already final, decoded again as context."""
        self._read = 0
        """End of the final text: `_final` is the decode of the tokens before it."""
        self._final = ""
        self._context = ""
        """The decode of the window's tokens before `_read`."""
        self._final_lengths = [0]
        """Per count of tokens: how much of `_final` its text starts with ..."""
        self._rests = [""]
        """... and the text after that."""

    def decode_prefix(self, ids: Sequence[int], count: int) -> str:
        """The decode of `ids[:count]`; `ids` only grows from one call to the next."""
        if self._locality is None:
            return self._decode(ids[:count])
        for end in range(len(self._rests), len(ids) + 1):
            self._advance(ids, end)
            if self._locality is None:  # the window check failed on the way
                return self._decode(ids[:count])
        return self._final[: self._final_lengths[count]] + self._rests[count]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, ids: Sequence[int], end: int) -> None:
        """Takes in token `end - 1`."""
        window = self._decode(ids[self._prefix : end])
        if not window.startswith(self._context):
            self._locality = None
            return
        new = window[len(self._context) :]
        if new and not new.endswith(INCOMPLETE) and self._may_end_window(ids[end - 1]):
            self._final += new
            emitted = self._decode(ids[self._read : end])
            if emitted:  # context enough for what follows: the window moves on
                self._prefix, self._context = self._read, emitted
            else:
                self._context = window
            self._read = end
            new = ""
        self._final_lengths.append(len(self._final))
        self._rests.append(new)

    def _may_end_window(self, token_id: int) -> bool:
        assert self._locality is not None
        id_to_token = self._locality.id_to_token
        return id_to_token is None or not _BYTE_TOKEN.fullmatch(id_to_token(token_id) or "")
