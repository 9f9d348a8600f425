"""When a sequence stops, and the `finish_reason` object SGLang reports for it.

Shapes (as SGLang's FINISH_* classes serialise them):
    {"type": "stop", "matched": <token id or stop string>}
    {"type": "length", "length": <max_new_tokens>}
    {"type": "abort", "message": "..."}
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlfleet_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class FinishReason:
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message or "aborted"}

    @property
    def matched_token(self) -> bool:
        return self.type == "stop" and isinstance(self.matched, int)


def token_finish(
    output_ids: Sequence[int], params: SamplingParams, eos_token_ids: Collection[int]
) -> FinishReason | None:
    """Checks the newest token: length first, then eos and stop_token_ids (SGLang's order).

    `ignore_eos` turns off every token-based stop, stop_token_ids included, as in SGLang's
    `Req._check_token_based_finish`; stop strings still apply.
    """
    if not output_ids:
        return None
    if len(output_ids) >= params.max_new_tokens:
        return FinishReason("length", length=params.max_new_tokens)
    last = output_ids[-1]
    if not params.ignore_eos and (last in params.stop_token_ids or last in eos_token_ids):
        return FinishReason("stop", matched=last)
    return None


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string: what may yet become a stop."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
