"""The answer to a generation request aborted while the router held it, as an engine would have given it.

SGLang answers a request aborted before its prefill with no output at all: `{"text": "", "meta_info": {"id": rid,
"finish_reason": {"type": "abort", "message": "Abort before prefill"}, "prompt_tokens": 0, "completion_tokens": 0}}`
(with `output_ids: []` and `cached_tokens: 0` as its later versions and rlfleet-engine add). A request the router
never sent gets exactly that, in its route's shape: one output per prompt and sample, a list for a batch or n > 1
(each named by its rid as rlfleet-engine names them: the client's, `rid_<k>` per sample, one per prompt of a rid
list), streamed as one event each then `data: [DONE]` when the request asked for a stream; an OpenAI request, its
choices with finish_reason "abort" and empty outputs, usage counting nothing. The status is 200, as an engine's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse, Response

ABORT_MESSAGE = "Abort before prefill"
ABORT_FINISH = {"type": "abort", "message": ABORT_MESSAGE}
SSE_DONE = b"data: [DONE]\n\n"


def aborted_answer(route: str, body: Mapping[str, Any]) -> Response:
    """The answer to `body`, a request to `route` aborted before it reached an engine."""
    if route == "/generate":
        return _generate(body)
    return _openai(route, body)


def _samples(body: Mapping[str, Any], params: object) -> int:
    if isinstance(params, list):  # a batch's: one per prompt, alike
        params = params[0] if params else None
    n = params.get("n", 1) if isinstance(params, Mapping) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def _prompts(prompts: object) -> int | None:
    """How many prompts `prompts` holds if it is a batch (a list of texts or of id lists), else None."""
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)):
        return len(prompts)
    return None


def _output_ids(rid: object, batch: int | None, n: int) -> list[str]:
    """The ids of a request's outputs, as rlfleet-engine names them (SGLang draws those it does not take)."""
    size = batch or 1
    if isinstance(rid, list) and len(rid) == size and all(isinstance(r, str) and r for r in rid):
        return list(rid) if n == 1 else [f"{r}_{j}" for r in rid for j in range(n)]
    if isinstance(rid, str) and rid:
        return [rid] if batch is None and n == 1 else [f"{rid}_{k}" for k in range(size * n)]
    return [uuid.uuid4().hex for _ in range(size * n)]


def _sse(events: list[dict[str, Any]]) -> Response:
    body = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events) + SSE_DONE
    return Response(body, media_type="text/event-stream")


def _generate(body: Mapping[str, Any]) -> Response:
    batch = _prompts(body.get("text")) or _prompts(body.get("input_ids"))
    ids = _output_ids(body.get("rid"), batch, _samples(body, body.get("sampling_params")))
    outputs: list[dict[str, Any]] = [
        {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "id": rid,
                "finish_reason": dict(ABORT_FINISH),
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "cached_tokens": 0,
            },
        }
        for rid in ids
    ]
    single = batch is None and len(outputs) == 1
    if body.get("stream"):
        if not single:  # a batch's events say which output each is
            outputs = [{**output, "index": index} for index, output in enumerate(outputs)]
        return _sse(outputs)
    return JSONResponse(outputs[0] if single else outputs)


def _openai(route: str, body: Mapping[str, Any]) -> Response:
    chat = route == "/v1/chat/completions"
    n = _samples(body, body)
    prompt = body.get("prompt")
    batch = None if chat or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)) else _prompts(prompt)
    ids = _output_ids(body.get("rid"), batch, n)
    answer_id = ids[0] if len(ids) == 1 else uuid.uuid4().hex
    stream = bool(body.get("stream"))
    kind = "chat.completion" if chat else "text_completion"
    if chat and stream:
        kind += ".chunk"
    head = {"id": answer_id, "object": kind, "created": int(time.time()), "model": body.get("model", "default")}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    choices = [_choice(chat, stream, index, body) for index in range(len(ids))]
    if not stream:
        return JSONResponse({**head, "choices": choices, "usage": usage})
    events = []
    for choice in choices:
        if chat:  # a chat stream opens each choice with the assistant's role, and ends it with a chunk of its own
            events.append({**head, "choices": [{"index": choice["index"], "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}]})  # fmt: skip
        events.append({**head, "choices": [choice]})
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage"):
        events.append({**head, "choices": [], "usage": usage})
    return _sse(events)


def _choice(chat: bool, stream: bool, index: int, body: Mapping[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    if chat and stream:
        choice["delta"] = {}
    elif chat:
        choice["message"] = {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": None}
    else:
        choice["text"] = ""
    if not (chat and stream):
        choice["logprobs"] = None
    choice.update(finish_reason="abort", matched_stop=None)
    if body.get("return_token_ids") and not (chat and stream):
        choice["response_token_ids" if chat else "token_ids"] = []
    return choice
