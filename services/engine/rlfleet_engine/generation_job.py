"""One sequence being generated (a request with `n` > 1 becomes n jobs), and the output SGLang returns for it.

Output shape (non-incremental, as SGLang streams by default: every chunk is cumulative):
    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "weight_versions", "e2e_latency" (when finished),
     "input_token_logprobs" (the last prompt token's `[null, id, text]`, as SGLang's default logprob_start_len
     answers it) + "output_token_logprobs" (when return_logprob), ...}}
`weight_version` is the engine's version when the output was published; `weight_versions`, as SGLang's
(sglang/srt/utils/weight_versions.py), lists oldest first the spans of output tokens each version sampled,
`{"version", "start", "end"}` (token indices, end exclusive), so a sequence that ran across a weight load
is labelled with both versions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet_engine.incremental_detokenizer import Detokenizer, IncrementalDetokenizer
from rlfleet_engine.sampling_params import SamplingParams
from rlfleet_engine.stop_conditions import FinishReason, partial_stop_length

if TYPE_CHECKING:  # the sim backend runs jobs without torch
    import torch


@dataclass(eq=False)
class GenerationJob:
    rid: str
    input_ids: Sequence[int]
    """The prompt; never changed (the n samples of a prompt share one)."""
    params: SamplingParams
    deliver: Callable[[dict[str, Any]], None]
    """Receives every output this job publishes; called from the scheduler thread."""
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    generator: torch.Generator | None = None
    """The job's own random generator (a seeded request); None draws from the engine's."""
    created_at: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    """Every version that sampled a token of `output_ids`, oldest first."""
    version_starts: list[int] = field(default_factory=list)
    """Where in `output_ids` each of `weight_versions` began sampling."""
    finish: FinishReason | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    _stop_at: int | None = None  # where a matched stop string starts in the text decoded with special tokens
    _decoders: dict[bool, IncrementalDetokenizer] = field(default_factory=dict)
    """The running job's committed text, per skip_special_tokens (see `_committed`)."""
    _token_texts: dict[int, str] = field(default_factory=dict)
    """Each token id's text once decoded (`return_text_in_logprobs`): a streamed job publishes every token's at
    every output, which decoded them all again each time."""

    def append(self, token_id: int, logprob: float, top: list[tuple[float, int]], weight_version: str) -> None:
        """Records one token sampled under `weight_version`."""
        if not self.weight_versions or self.weight_versions[-1] != weight_version:
            self.weight_versions.append(weight_version)
            self.version_starts.append(len(self.output_ids))
        self.last_token_at = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if self.top_logprobs_num:
            self.output_top_logprobs.append(top)

    def finish_with(self, reason: FinishReason) -> None:
        self.finish = reason
        self.finished_at = time.monotonic()

    def check_stop_strings(self, tokenizer: Detokenizer) -> FinishReason | None:
        """Looks for a stop string in the output decoded with its special tokens, as SGLang does (so a stop string
        such as "<|im_end|>" matches whatever `skip_special_tokens` says). Only the newest tokens can complete a
        match, an earlier one having stopped the job, so only they are decoded: a stop string of L characters
        lies within the last 4L + 1 tokens even when each byte of a character is a token of its own (the whole
        output, decoded at every step, made a long generation with a stop string quadratic). Of stop strings
        the same token completes, the first listed is the match, as SGLang checks them."""
        if not self.params.stop:
            return None
        longest = max(len(s) for s in self.params.stop)
        tail = tokenizer.decode(self.output_ids[-(4 * longest + 1) :], skip_special_tokens=False)
        matched = next((stop for stop in self.params.stop if stop in tail), None)
        if matched is None:
            return None
        start = tokenizer.decode(self.output_ids, skip_special_tokens=False).find(matched)
        if start < 0:  # the tail alone decoded otherwise (a character cut at its start): no match in the output
            return None
        self._stop_at = start
        return FinishReason("stop", matched=matched)

    def text(self, tokenizer: Detokenizer) -> str:
        """The output text, without the matched stop token or string unless no_stop_trim.

        A finished job's text is the whole decode. A running job's (streamed: SGLang's chunks carry the whole text
        so far) is only text no later token can change, so each is a prefix of the next and of the final text and
        a client's deltas add up: the decoder's committed text (see `IncrementalDetokenizer`: no character whose
        last bytes are still to come, no byte group that one more byte may rewrite), without the tail that may yet
        become a stop string (as SGLang holds it back).
        """
        if self.finish is None:
            return self._committed_text(tokenizer)
        ids = self.output_ids
        trim = not self.params.no_stop_trim
        if trim and self.finish.matched_token:
            ids = ids[:-1]
        if not trim or not self.params.stop or self._stop_at is None:
            return tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self._text_before_stop(tokenizer, self._stop_at)

    def _committed_text(self, tokenizer: Detokenizer) -> str:
        """The running job's text. Before a stop string that may yet come it ends at a point of the text decoded with
        special tokens (where stop strings are found) no later than where that stop string would begin: the final
        text, cut before the stop string, keeps at least the tokens before that point (see `_text_before_stop`)."""
        skip = self.params.skip_special_tokens
        count = len(self.output_ids)
        if not self.params.stop or self.params.no_stop_trim:
            return self._committed(tokenizer, count, skip)[1]
        point, full = self._committed(tokenizer, count, False)
        end = len(full) - partial_stop_length(full, self.params.stop)
        if not skip:
            return full[:end]
        head = full
        while len(head) > end:
            point, head = self._committed(tokenizer, point - 1, False)
        return self._committed(tokenizer, point, True)[1]

    def _committed(self, tokenizer: Detokenizer, count: int, skip_special_tokens: bool) -> tuple[int, str]:
        """The latest committed point at or before `count` output tokens, and its text. Decoded incrementally: a
        stream of N tokens decoded whole at every chunk cost O(N^2) tokens of decoding."""
        decoder = self._decoders.get(skip_special_tokens)
        if decoder is None:
            decoder = self._decoders[skip_special_tokens] = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        return decoder.committed(self.output_ids, count)

    def _text_before_stop(self, tokenizer: Detokenizer, end: int) -> str:
        """The finished output's text before the matched stop string, which starts at `end` in the output decoded
        with its special tokens."""
        full = tokenizer.decode(self.output_ids, skip_special_tokens=False)
        if not self.params.skip_special_tokens:
            return full[:end]
        # The text without special tokens has other positions: decode the whole tokens before `end`, then add
        # the part of the token `end` splits, unless that token is special (skipped whole).
        cut = len(self.output_ids)
        head = full
        while len(head) > end:
            cut -= 1
            head = tokenizer.decode(self.output_ids[:cut], skip_special_tokens=False)
        text = tokenizer.decode(self.output_ids[:cut], skip_special_tokens=True)
        if len(head) < end and tokenizer.decode(self.output_ids[cut : cut + 1], skip_special_tokens=True):
            text += full[len(head) : end]
        return text

    def _version_spans(self, weight_version: str) -> list[dict[str, Any]]:
        if not self.weight_versions:  # produced by nothing yet: the version it would have used, over no token
            return [{"version": weight_version, "start": 0, "end": 0}]
        ends = [*self.version_starts[1:], len(self.output_ids)]
        return [
            {"version": version, "start": start, "end": end}
            for version, start, end in zip(self.weight_versions, self.version_starts, ends, strict=True)
        ]

    def output(self, tokenizer: Detokenizer, weight_version: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish.to_json() if self.finish else None,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "weight_versions": self._version_spans(weight_version),
        }
        if self.return_logprob:
            # SGLang's default logprob_start_len (-1) starts the prompt's logprobs at its last token, and the first
            # prompt logprob it reports is always null: one entry, and one null row of top logprobs.
            last = self.input_ids[-1]
            meta["input_token_logprobs"] = [[None, last, self._token_text(tokenizer, last)]]
            meta["output_token_logprobs"] = [
                [lp, tid, self._token_text(tokenizer, tid)]
                for lp, tid in zip(self.output_logprobs, self.output_ids, strict=True)
            ]
            if self.top_logprobs_num:
                meta["input_top_logprobs"] = [None]
                meta["output_top_logprobs"] = [
                    [[lp, tid, self._token_text(tokenizer, tid)] for lp, tid in row] for row in self.output_top_logprobs
                ]
        if self.finished_at is not None:
            meta["e2e_latency"] = self.finished_at - self.created_at
        return {"text": self.text(tokenizer), "output_ids": list(self.output_ids), "meta_info": meta}

    def _token_text(self, tokenizer: Detokenizer, token_id: int) -> str | None:
        if not self.return_text_in_logprobs:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text
