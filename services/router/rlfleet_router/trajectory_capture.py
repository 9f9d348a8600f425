"""Which requests join a trajectory, and the turn (prompt ids, output ids, logprobs) read from an engine's answer.

A request joins trajectory T when it carries the header `X-Rlfleet-Trajectory-Id: T`. The router
forwards it unchanged, so the request itself must ask the engine for what the trajectory needs; a
request that does not is refused before it reaches an engine, with the field to set:

    /generate             input_ids (one prompt), return_logprob: true
    /v1/completions       return_token_ids: true, logprobs: 0 (or more), one prompt
    /v1/chat/completions  return_token_ids: true, logprobs: true

and in every case n = 1 and stream false (a trajectory follows one sample, read whole); /v1/completions also
echo false (the prompt's logprobs would come first). The output ids are read
where SGLang answers them: `output_ids` (/generate), a completion choice's `token_ids`, a chat choice's
`response_token_ids` (`token_ids` in SGLang releases whose chat choice names them as a completion's does); the
versions that sampled them from `weight_versions` spans (meta_info, or an OpenAI answer's metadata).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeGuard

from rlfleet.errors import InvalidInput
from rlfleet_router.trajectory_store import TOKEN_ID_LIMIT, Turn

TRAJECTORY_HEADER = "x-rlfleet-trajectory-id"
MAX_TRAJECTORY_ID_CHARS = 256


def trajectory_id(headers: Mapping[str, str]) -> str | None:
    value = headers.get(TRAJECTORY_HEADER)
    if value is None:
        return None
    try:  # HTTP hands header values over as latin-1; a client sends the id's UTF-8, as a URL naming it carries
        value = value.encode("latin-1").decode("utf-8")
    except UnicodeEncodeError:  # not read from the wire as latin-1: already text
        pass
    except UnicodeDecodeError:
        raise InvalidInput(f"header {TRAJECTORY_HEADER}: must be UTF-8 text") from None
    value = value.strip()
    if not value or len(value) > MAX_TRAJECTORY_ID_CHARS:
        raise InvalidInput(f"header {TRAJECTORY_HEADER}: must be 1 to {MAX_TRAJECTORY_ID_CHARS} characters")
    return value


def _is_token_ids(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(t, int) and 0 <= t < TOKEN_ID_LIMIT for t in value)


def _samples(body: Mapping[str, Any], route: str) -> object:
    if route == "/generate":
        params = body.get("sampling_params")
        if isinstance(params, list) and len(params) == 1:  # one per prompt, of the one prompt
            params = params[0]
        elif isinstance(params, list):
            return len(params)
        return params.get("n", 1) if isinstance(params, Mapping) else 1
    return body.get("n", 1)


def check_trajectory_request(route: str, body: Mapping[str, Any]) -> None:
    """Raises InvalidInput naming the field if `body` cannot yield a turn of a trajectory."""
    where = f"{route} in a trajectory ({TRAJECTORY_HEADER})"
    if body.get("stream"):
        raise InvalidInput(f"stream: must be false for {where}")
    if _samples(body, route) not in (1, None):
        raise InvalidInput(f"n: must be 1 for {where}; send one request per sample")
    if route == "/generate":
        ids = body.get("input_ids")
        if not (ids and _is_token_ids(ids)):
            raise InvalidInput(
                f"input_ids: one prompt as token ids (0 to {TOKEN_ID_LIMIT - 1}) is required for {where} (text is not)"
            )
        if body.get("return_logprob") is not True:
            raise InvalidInput(f"return_logprob: must be true for {where}")
        return
    if body.get("return_token_ids") is not True:
        raise InvalidInput(f"return_token_ids: must be true for {where}")
    if route == "/v1/chat/completions":
        if body.get("logprobs") is not True:
            raise InvalidInput(f"logprobs: must be true for {where}")
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise InvalidInput(f"prompt: one prompt (text or token ids) is required for {where}")
    if not isinstance(body.get("logprobs"), int) or isinstance(body.get("logprobs"), bool):
        raise InvalidInput(f"logprobs: must be an integer (0 for the sampled tokens only) for {where}")
    if body.get("echo"):
        # SGLang then puts the prompt's logprobs (the first one null) before the output's in `token_logprobs`:
        # the turn could not be read, and the trajectory would be lost only once its sample is asked for.
        raise InvalidInput(f"echo: must be false for {where}")


def _ids(value: object, what: str) -> tuple[int, ...]:
    if not _is_token_ids(value):
        raise ValueError(f"the answer has no {what} (a list of token ids from 0 to {TOKEN_ID_LIMIT - 1})")
    return tuple(value)


def turn_from_answer(
    route: str, request: Mapping[str, Any], answer: bytes, engine: str, engine_version: str | None
) -> Turn:
    """The turn an engine's 200 answer to `request` holds; ValueError if the answer lacks a part or is not
    shaped as the route's answer is."""
    try:
        return _turn(route, request, json.loads(answer), engine, engine_version)
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"the answer is not a {route} answer with tokens and logprobs: {exc!r}") from exc


def _sampled_by(spans: object) -> tuple[str, ...]:
    """The versions that sampled a turn's tokens, oldest first, from SGLang's meta_info.weight_versions (spans
    `{"version", "start", "end"}`, rlfleet-engine's too); () when the engine reports only weight_version."""
    if not isinstance(spans, list) or not all(isinstance(s, dict) and isinstance(s.get("version"), (str, int))
                                              for s in spans):  # fmt: skip
        return ()
    return tuple(str(span["version"]) for span in spans)


def _chat_ids_field(choice: Mapping[str, Any]) -> str:
    """Where a chat choice holds its output ids: SGLang has named them `response_token_ids`, and in later
    releases `token_ids`, as in a completion choice."""
    return "token_ids" if "response_token_ids" not in choice and "token_ids" in choice else "response_token_ids"


def _aborted_before_prefill(finish_reason: object, output_ids: object) -> bool:
    """An abort that came before the request generated anything: SGLang answers one still in its queue (a weight
    update's abort_all_requests, an abort by rid) with no output ids or logprobs at all ("Abort before prefill").
    It is a turn with no output, which the client resumes, not an answer missing its tokens."""
    aborted = finish_reason == "abort" or (isinstance(finish_reason, dict) and finish_reason.get("type") == "abort")
    return aborted and output_ids in (None, [])


def _turn(route: str, request: Mapping[str, Any], parsed: Any, engine: str, engine_version: str | None) -> Turn:
    rid = request.get("rid") if isinstance(request.get("rid"), str) else None
    sampled_by: tuple[str, ...] = ()
    outputs: tuple[int, ...]
    logprobs: tuple[float, ...]
    if route == "/generate":
        meta = parsed["meta_info"]
        if _aborted_before_prefill(meta.get("finish_reason"), parsed.get("output_ids")):
            outputs, logprobs = (), ()
        else:
            outputs = _ids(parsed.get("output_ids"), "output_ids")
            logprobs = tuple(float(entry[0]) for entry in meta["output_token_logprobs"])
        prompt = _ids(request.get("input_ids"), "input_ids")
        version = meta.get("weight_version")
        sampled_by = _sampled_by(meta.get("weight_versions"))
        rid = rid or meta.get("id")
    else:
        choice = parsed["choices"][0]
        prompt = _ids(choice.get("prompt_token_ids"), "prompt_token_ids")
        chat = route == "/v1/chat/completions"
        ids_field = _chat_ids_field(choice) if chat else "token_ids"
        if _aborted_before_prefill(choice.get("finish_reason"), choice.get(ids_field)):
            outputs, logprobs = (), ()
        elif chat:
            outputs = _ids(choice.get(ids_field), ids_field)
            logprobs = tuple(float(c["logprob"]) for c in choice["logprobs"]["content"])
        else:
            outputs = _ids(choice.get("token_ids"), "token_ids")
            logprobs = tuple(float(lp) for lp in choice["logprobs"]["token_logprobs"])
        metadata = parsed.get("metadata") if isinstance(parsed.get("metadata"), dict) else {}
        version = metadata.get("weight_version")
        sampled_by = _sampled_by(metadata.get("weight_versions"))
        rid = rid or parsed.get("id")
    if len(logprobs) != len(outputs):
        raise ValueError(f"the answer has {len(outputs)} output tokens but {len(logprobs)} logprobs")
    return Turn(
        rid=rid,
        prompt_ids=prompt,
        output_ids=outputs,
        output_logprobs=logprobs,
        weight_version=str(version) if version is not None else engine_version,
        engine=engine,
        weight_versions=sampled_by,
    )
