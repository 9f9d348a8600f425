"""Client of the router's SGLang-compatible `/generate`: a batch of token-id prompts in, completions out.

The router answers in SGLang's shape. Parsing is tolerant where engines differ (the weight version
may be a string; output ids may or may not end in EOS) and strict where training depends on it:
every response token needs its rollout logprob, or that completion is reported as failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from rlfleet.errors import Unavailable
from rlfleet.v1.runs_pb2 import SamplingParams
from rlfleet.v1.samples_pb2 import FinishReason
from rlfleet_rollout.http_retry import request_json

_FINISH_REASONS = {
    "stop": FinishReason.FINISH_REASON_STOP,
    "length": FinishReason.FINISH_REASON_LENGTH,
    "abort": FinishReason.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class Completion:
    """One generated response; `error` is set (and the tokens empty) when it cannot be trained on."""

    output_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    text: str = ""
    finish_reason: FinishReason = FinishReason.FINISH_REASON_UNSPECIFIED
    weight_version: int | None = None
    cached_tokens: int = 0
    error: str = ""


def sampling_body(params: SamplingParams, *, greedy: bool = False) -> dict[str, Any]:
    """SGLang's `sampling_params` for a resolved SamplingParams (greedy: temperature 0)."""
    body: dict[str, Any] = {
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": -1 if greedy else params.top_k,
        "max_new_tokens": params.max_new_tokens,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def parse_weight_version(value: object) -> int | None:
    """SGLang reports the version as a string label; rlfleet's versions are integers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def parse_completion(item: Any) -> Completion:
    """One element of SGLang's batch answer."""
    if not isinstance(item, dict):
        return Completion(error=f"router returned a {type(item).__name__} where a completion was expected")
    meta = item.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    reason = _FINISH_REASONS.get(str(finish_type), FinishReason.FINISH_REASON_UNSPECIFIED)
    version = parse_weight_version(meta.get("weight_version"))
    cached = int(meta.get("cached_tokens") or 0)
    if reason == FinishReason.FINISH_REASON_ABORT:
        message = finish.get("message", "") if isinstance(finish, dict) else ""
        return Completion(finish_reason=reason, weight_version=version, error=f"generation aborted: {message}".strip())
    output_ids = item.get("output_ids")
    entries = meta.get("output_token_logprobs")
    if not isinstance(output_ids, list) or not isinstance(entries, list):
        return Completion(error="router answer lacks output_ids or meta_info.output_token_logprobs")
    try:
        ids = tuple(int(t) for t in output_ids)
        logprobs = tuple(float(entry[0]) for entry in entries)
    except (TypeError, ValueError, IndexError) as exc:
        return Completion(error=f"router answer has malformed tokens or logprobs: {exc}")
    if len(logprobs) != len(ids):
        return Completion(error=f"engine returned {len(ids)} output ids but {len(logprobs)} logprobs")
    if not all(math.isfinite(lp) for lp in logprobs):
        return Completion(error="engine returned a non-finite logprob")
    return Completion(
        output_ids=ids,
        logprobs=logprobs,
        text=str(item.get("text") or ""),
        finish_reason=reason,
        weight_version=version,
        cached_tokens=cached,
    )


class RouterClient:
    def __init__(self, client: httpx.AsyncClient, base_url: str, *, timeout_s: float) -> None:
        self.client = client
        self.base_url = base_url
        self.timeout_s = timeout_s

    async def generate(
        self, prompts: list[list[int]], sampling: dict[str, Any] | list[dict[str, Any]], rids: list[str]
    ) -> list[Completion]:
        """One completion per prompt, in order; raises Unavailable/DeadlineExceeded when the router fails."""
        body = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True, "rid": rids}
        answer = await request_json(
            self.client, "POST", f"{self.base_url}/generate", deadline_s=self.timeout_s, body=body
        )
        if not isinstance(answer, list) or len(answer) != len(prompts):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise Unavailable(f"router answered a batch of {len(prompts)} prompts with {got} completions")
        return [parse_completion(item) for item in answer]
