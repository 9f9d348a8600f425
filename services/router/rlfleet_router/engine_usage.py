"""What an engine reports about a request's prompt, read from its answer while the answer is relayed.

The router never changes an answer; it only looks at a copy of the bytes going by to count the
prompt tokens and the cached prompt tokens the engine reports (SGLang's `meta_info.prompt_tokens` /
`meta_info.cached_tokens`, OpenAI's `usage.prompt_tokens` / `usage.prompt_tokens_details.cached_tokens`),
which is the fleet's real prefix-cache hit rate. Plain JSON answers are parsed once at the end (up to
a size limit). A server-sent-event stream reports its usage once, and only the events that carry it are
parsed: in /generate's stream (cumulative chunks) each sample's finished event, whose `meta_info.finish_reason`
is an object; in an OpenAI stream the usage chunk (`"choices": []`) sent last when the request sets
`stream_options.include_usage`. An OpenAI chunk with a choice is never counted, even with a `usage`
(`continuous_usage_stats` puts a running count in every one): the usage chunk already has the total.
SGLang puts cached tokens in OpenAI usage only when it runs with `--enable-cache-report` (and then only if
there are some); without it they count as 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

# Answers larger than this are relayed without being counted, so a huge answer never doubles in memory.
MAX_PARSED_BYTES = 8 * 1024 * 1024
# Found in the raw event before it is parsed: /generate's finish reason (an object), an OpenAI usage chunk.
_USAGE_EVENT = re.compile(rb'"finish_reason":\s*\{|"choices":\s*\[\s*\]')


@dataclass(frozen=True)
class PromptUsage:
    prompt_tokens: int
    cached_tokens: int


def _items(answer: object) -> Iterator[dict[str, object]]:
    if isinstance(answer, list):
        for item in answer:
            yield from _items(item)
    elif isinstance(answer, dict):
        yield answer


def usage_of(answer: object, stream_event: bool = False) -> PromptUsage:
    """Prompt and cached tokens summed over every item of a /generate or OpenAI-style answer.

    A `stream_event` counts only a finished /generate item or an OpenAI usage chunk (no choices).
    """
    prompt = cached = 0
    for item in _items(answer):
        meta = item.get("meta_info")
        usage = item.get("usage")
        if isinstance(meta, dict):
            if stream_event and not isinstance(meta.get("finish_reason"), dict):
                continue
            prompt += int(meta.get("prompt_tokens") or 0)
            cached += int(meta.get("cached_tokens") or 0)
        elif isinstance(usage, dict):
            if stream_event and item.get("choices"):
                continue
            prompt += int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            cached += int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return PromptUsage(prompt, cached)


class UsageTap:
    """Fed every relayed chunk; `result()` then gives the usage, or None if the answer held none or was too big."""

    def __init__(self, content_type: str) -> None:
        self._stream = content_type.startswith("text/event-stream")
        self._buffer = bytearray()
        self._overflow = False
        self._prompt = 0
        self._cached = 0
        self._seen = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buffer += chunk
        if self._stream:
            *events, rest = bytes(self._buffer).split(b"\n\n")
            self._buffer = bytearray(rest)
            for event in events:
                if _USAGE_EVENT.search(event):
                    self._add(event.removeprefix(b"data:").strip())
        if len(self._buffer) > MAX_PARSED_BYTES:
            self._overflow = True
            self._buffer = bytearray()

    def result(self) -> PromptUsage | None:
        if not self._stream and not self._overflow and self._buffer:
            self._add(bytes(self._buffer))
        return PromptUsage(self._prompt, self._cached) if self._seen and self._prompt else None

    def _add(self, payload: bytes) -> None:
        try:
            usage = usage_of(json.loads(payload), stream_event=self._stream)
        except (ValueError, TypeError):
            return
        self._seen = True
        self._prompt += usage.prompt_tokens
        self._cached += usage.cached_tokens
