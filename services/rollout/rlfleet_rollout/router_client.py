"""Client of the router's SGLang-compatible `/generate` (a batch of token-id prompts in, completions out)
and of its trajectory cache (`/trajectories/{id}`: a multi-turn sample as the engines produced it).

The router answers in SGLang's shape. Parsing is tolerant where engines differ (the weight version
may be a string; output ids may or may not end in EOS) and strict where training depends on it:
every response token needs its rollout logprob, or that completion is reported as failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

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
    text: str | None = None
    """The engine's text of `output_ids`; None when it sent none. "" is a text: a response that was only a
    stop string, which the engine cut."""
    finish_reason: FinishReason = FinishReason.FINISH_REASON_UNSPECIFIED
    weight_version: int | None = None
    weight_versions: tuple[int, ...] = ()
    """Every version that produced `output_ids`, oldest first (empty when no tokens or none reported)."""
    cached_tokens: int = 0
    error: str = ""

    def response_text(self, decode: Callable[[list[int]], str]) -> str:
        """The engine's text, else `output_ids` decoded."""
        return self.text if self.text is not None else decode(list(self.output_ids))


@dataclass(frozen=True)
class Trajectory:
    """The router's record of a multi-turn conversation: every turn's generated tokens (loss mask 1, the
    engine's logprobs) and the tokens between turns (loss mask 0, logprob 0.0), after the first prompt."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    weight_versions: tuple[int | None, ...]
    """The version of every turn's engine, in order of first use."""


TRAJECTORY_HEADER = "X-Rlfleet-Trajectory-Id"
# A trajectory left behind costs the router's cache room until it is evicted, not a sample: worth a short wait.
FORGET_TIMEOUT_S = 5.0


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


def parse_weight_versions(value: object, version: int | None) -> tuple[int, ...]:
    """The versions that sampled the output's tokens, oldest first, from meta_info.weight_versions (SGLang's spans
    `{"version", "start", "end"}`, rlfleet-engine's too); an engine that reports only `weight_version` (SGLang
    before the spans) names that one."""
    if isinstance(value, list):
        labels = (span.get("version") if isinstance(span, dict) else None for span in value)
        versions = tuple(v for v in (parse_weight_version(label) for label in labels) if v is not None)
        if versions:
            return versions
    return (version,) if version is not None else ()


def _parse_tokens(item: dict[str, Any], meta: dict[str, Any]) -> tuple[tuple[int, ...], tuple[float, ...]] | str:
    """(output ids, their logprobs), or why they cannot be trained on."""
    output_ids = item.get("output_ids")
    entries = meta.get("output_token_logprobs")
    if not isinstance(output_ids, list) or not isinstance(entries, list):
        return "router answer lacks output_ids or meta_info.output_token_logprobs"
    try:
        ids = tuple(int(t) for t in output_ids)
        logprobs = tuple(float(entry[0]) for entry in entries)
    except (TypeError, ValueError, IndexError) as exc:
        return f"router answer has malformed tokens or logprobs: {exc}"
    if len(logprobs) != len(ids):
        return f"engine returned {len(ids)} output ids but {len(logprobs)} logprobs"
    if not all(math.isfinite(lp) for lp in logprobs):
        return "engine returned a non-finite logprob"
    return ids, logprobs


def _text(item: dict[str, Any]) -> str | None:
    text = item.get("text")
    return None if text is None else str(text)


def parse_completion(item: Any) -> Completion:
    """One element of SGLang's batch answer. An aborted completion keeps the tokens it produced before
    the abort (when they are well-formed), so a partial rollout can be resumed from them."""
    if not isinstance(item, dict):
        return Completion(error=f"router returned a {type(item).__name__} where a completion was expected")
    meta = item.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    reason = _FINISH_REASONS.get(str(finish_type), FinishReason.FINISH_REASON_UNSPECIFIED)
    version = parse_weight_version(meta.get("weight_version"))
    versions = parse_weight_versions(meta.get("weight_versions"), version)
    cached = int(meta.get("cached_tokens") or 0)
    tokens = _parse_tokens(item, meta)
    if reason == FinishReason.FINISH_REASON_ABORT:
        message = finish.get("message", "") if isinstance(finish, dict) else ""
        ids, logprobs = tokens if not isinstance(tokens, str) else ((), ())
        return Completion(
            output_ids=ids,
            logprobs=logprobs,
            text=_text(item) if ids else "",
            finish_reason=reason,
            weight_version=version,
            weight_versions=versions if ids else (),
            cached_tokens=cached,
            error=f"generation aborted: {message}".strip(),
        )
    if isinstance(tokens, str):
        return Completion(error=tokens)
    ids, logprobs = tokens
    return Completion(
        output_ids=ids,
        logprobs=logprobs,
        text=_text(item),
        finish_reason=reason,
        weight_version=version,
        weight_versions=versions,
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

    async def generate_turn(
        self, prompt: list[int], sampling: dict[str, Any], rid: str, trajectory_id: str
    ) -> Completion:
        """One completion of one prompt, recorded by the router as a turn of `trajectory_id`."""
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "rid": rid}
        answer = await request_json(
            self.client,
            "POST",
            f"{self.base_url}/generate",
            deadline_s=self.timeout_s,
            body=body,
            headers={TRAJECTORY_HEADER: trajectory_id},
        )
        return parse_completion(answer)

    async def served_context_length(self, timeout_s: float) -> int:
        """The context length the engines serve, in tokens (`max_model_len` of /v1/models, as SGLang and rlfleet-engine
        answer it through the router: one engine's); 0 when the answer does not say. Raises as `request_json`."""
        answer = await request_json(self.client, "GET", f"{self.base_url}/v1/models", deadline_s=timeout_s)
        try:
            value = answer["data"][0]["max_model_len"]
        except (KeyError, IndexError, TypeError):
            return 0
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    async def trajectory(self, trajectory_id: str) -> Trajectory:
        """The cached trajectory; InvalidInput when the router no longer holds it or it does not line up."""
        url = f"{self.base_url}/trajectories/{quote(trajectory_id, safe='')}"
        answer = await request_json(self.client, "GET", url, deadline_s=self.timeout_s)
        try:
            trajectory = Trajectory(
                prompt_ids=tuple(int(t) for t in answer["prompt_ids"]),
                response_ids=tuple(int(t) for t in answer["response_ids"]),
                logprobs=tuple(float(lp) for lp in answer["response_logprobs"]),
                loss_mask=tuple(int(m) for m in answer["loss_mask"]),
                weight_versions=tuple(parse_weight_version(v) for v in answer["weight_versions"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise Unavailable(f"router answered {url} without a well-formed trajectory: {exc!r}") from exc
        n = len(trajectory.response_ids)
        if len(trajectory.logprobs) != n or len(trajectory.loss_mask) != n:
            raise Unavailable(f"router's trajectory {trajectory_id!r} has per-token lists of different lengths")
        return trajectory

    async def forget_trajectory(self, trajectory_id: str) -> None:
        """Frees the router's copy of a trajectory read for good, so finished episodes do not crowd out the ones
        under way in its cache; one already gone (evicted, a router restarted since) is forgotten already."""
        url = f"{self.base_url}/trajectories/{quote(trajectory_id, safe='')}"
        try:  # once: the router answered the read just before
            response = await self.client.delete(url, timeout=min(self.timeout_s, FORGET_TIMEOUT_S))
        except httpx.HTTPError as exc:
            raise Unavailable(f"DELETE {url} failed: {exc!r}") from exc
        if response.status_code not in (200, 404):
            raise Unavailable(f"DELETE {url} answered HTTP {response.status_code}: {response.text[:200]}")
