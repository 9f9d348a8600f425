"""The text of a growing output that no later token can change, decoded a few tokens at a time.

A streamed job publishes its text after every token, and each published text must be a prefix of every later one
and of the final one (the whole decode), or a client's deltas come out wrong. The whole decode of a running output
is no such text: a character whose last bytes are still to come decodes as U+FFFD; with ByteFallback (Llama 2,
Mistral) a run of byte tokens decodes as one group, all U+FFFD while invalid, so one more byte turns "é" into three
U+FFFD; `clean_up_tokenization_spaces` turns "a '" into "a'" once "s" comes. As SGLang's detokenizer publishes only
what its window has committed, `IncrementalDetokenizer` commits text at points: token counts r whose decode
`decode(ids[:r])` starts the decode of every longer output. Decoding only a window (as SGLang, vLLM and TGI do) also
spares a stream of N tokens the O(N^2) tokens of decoding its whole output at every chunk.

The window runs from a prefix offset (tokens already committed, kept as left context: a WordPiece joiner, a
Metaspace leading space or a byte-level character depends on the token before) to the newest token, and the part
of its text past its context's text is committed when it does not end in U+FFFD. That commits exactly
`decode(ids[:r])`, and it starts every longer output's decode, when decoding is local: the text a token adds
depends only on itself and the tokens just before it. `decoding_locality` decides that from the tokenizer's decoder:
  * local: a Hugging Face fast tokenizer whose decoder chain is made of ByteLevel, Metaspace, WordPiece, Fuse,
    single-character Replace, Strip of leading characters (Llama's), ByteFallback, or no decoder at all; and any
    tokenizer declaring `decodes_token_by_token` (the `sim` backend's, one character per token);
  * local, then cleaned up: the same with transformers' `clean_up_tokenization_spaces` in effect. It rewrites
    " ." to "." and the like across token boundaries, so the raw text (decoded without it) is committed as above,
    and a point is also where the raw text ends in no beginning of a pattern the clean-up rewrites (" ", " '",
    " n", ...): the clean-up of such a text followed by any other is the clean-ups of the two, one after the other;
  * anything else commits nothing: slow (Python) tokenizers (`spaces_between_special_tokens`, per-class decode
    rules), classes that override decode or the clean-up, a clean-up the probe cannot tell is applied, and other
    decoders (CTC merges repeated tokens, BPEDecoder's end-of-word suffix, a Replace or Strip acting across tokens
    after Fuse). A running job with such a tokenizer publishes no text; its final output has it all.
Two rules keep a window exact for the local ones: its context decodes to some text (a window starting at a
skipped special token would lose the Metaspace space or WordPiece joiner of the token after it), and with
ByteFallback it never ends right after a byte token, nor after a token that decodes to nothing (bytes in a row
decode as one group, skipped special tokens between them or not, so a byte that arrives later can change the text
of those before it). A window that still does not start with its context's text (a decoder behaving
otherwise than described) commits nothing more. Tokens that decode to nothing (skipped special tokens) or to an
unfinished character widen the window until a token with text ends it, as in SGLang.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from rlfleet_engine.stop_conditions import partial_stop_length

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
    must not end right after one); None otherwise."""
    clean_up: Callable[[str], str] | None = None
    """With `clean_up_tokenization_spaces` in effect, the clean-up decode applies to the raw text; None otherwise."""


def decoding_locality(tokenizer: object) -> Locality | None:
    """How `tokenizer` decodes locally, or None when only the whole decode is exact."""
    if getattr(tokenizer, "decodes_token_by_token", False):
        return Locality()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _decodes_as_the_fast_base(tokenizer):
        return None
    cleans_up = _cleans_up(tokenizer, backend)
    if cleans_up is None:
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
    clean_up = cast(Any, tokenizer).clean_up_tokenization if cleans_up else None
    return Locality(backend.id_to_token if byte_fallback else None, clean_up)


def _flatten(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        return [stage for inner in decoder["decoders"] for stage in _flatten(inner)]
    return [decoder]


def _decodes_as_the_fast_base(tokenizer: object) -> bool:
    """True if `decode` is the backend's decode plus the clean-up, as the fast tokenizers' base class has them."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode
        and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
        and getattr(cls, "clean_up_tokenization", None) is PreTrainedTokenizerBase.clean_up_tokenization
    )


def _cleans_up(tokenizer: Any, backend: Any) -> bool | None:
    """Whether decode applies `clean_up_tokenization_spaces` (transformers 5 ignores it for BPE models); None when
    the probe cannot tell (its raw decode shows none of the patterns)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    ids = backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
    raw = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if not any(p in raw for p in _CLEANUP_PATTERNS):
        return None
    return tokenizer.decode(ids) != raw


class IncrementalDetokenizer:
    """The committed text of one growing sequence: for each count of tokens, the latest point r at or before it and
    `decode(ids[:r], skip_special_tokens)`, which every later decode starts with (see the module docstring), at the
    cost of a few small decodes per token."""

    def __init__(self, tokenizer: Detokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._locality = decoding_locality(tokenizer)
        self._prefix = 0
        """Start of the window: tokens already committed, decoded again as context."""
        self._read = 0
        """End of the raw text committed: the tokens before it decode to it (before any clean-up)."""
        self._context = ""
        """The decode of the window's tokens before `_read`."""
        self._pending = ""
        """With the clean-up, the raw text past the last point, still to be cleaned up."""
        self._text = ""
        """The decode of the tokens before the latest point."""
        self._points = [0]
        """Per count of tokens: the latest point at or before it ..."""
        self._lengths = [0]
        """... and the length of its decode (a prefix of `_text`)."""

    def committed(self, ids: Sequence[int], count: int) -> tuple[int, str]:
        """The latest point r <= count and `decode(ids[:r])`; `ids` only grows from one call to the next."""
        for end in range(len(self._points), len(ids) + 1):
            if self._locality is not None:
                self._advance(ids, end)
            self._points.append(self._points[-1] if self._read < end or self._pending else end)
            self._lengths.append(len(self._text))
        return self._points[count], self._text[: self._lengths[count]]

    def _decode(self, ids: Sequence[int]) -> str:
        if self._locality is not None and self._locality.clean_up is not None:
            tokenizer: Any = self._tokenizer  # a fast tokenizer: decode takes the clean-up switch
            return str(tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False))
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, ids: Sequence[int], end: int) -> None:
        """Takes in token `end - 1`, committing the window's text when it may end there."""
        assert self._locality is not None
        window = self._decode(ids[self._prefix : end])
        if not window.startswith(self._context):
            self._locality = None
            return
        new = window[len(self._context) :]
        if not new or new.endswith(INCOMPLETE) or not self._may_end_window(ids[end - 1]):
            return
        emitted = self._decode(ids[self._read : end])
        if emitted:  # context enough for what follows: the window moves on
            self._prefix, self._context = self._read, emitted
        else:
            self._context = window
        self._read = end
        clean_up = self._locality.clean_up
        if clean_up is None:
            self._text += new
            return
        self._pending += new
        if not partial_stop_length(self._pending, _CLEANUP_PATTERNS):
            self._text += clean_up(self._pending)
            self._pending = ""

    def _may_end_window(self, token_id: int) -> bool:
        assert self._locality is not None
        id_to_token = self._locality.id_to_token
        if id_to_token is None:
            return True
        # Bytes on both sides of a skipped special token decode as one group, as if it were not there.
        return not _BYTE_TOKEN.fullmatch(id_to_token(token_id) or "") and bool(self._decode([token_id]))
