"""What the routing policies see of an OpenAI request: its prompt and budget in /generate's terms.

The policies read a /generate body (`text` or `input_ids`, `sampling_params.max_new_tokens` and
`n`). An OpenAI body is mapped onto those names for routing only; the engine still receives the
request exactly as it arrived. A chat's messages become one text (their contents in order), so
turns of one conversation share a prefix and go to the engine that holds it in its cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _message_text(message: object) -> str:
    if not isinstance(message, Mapping):
        return ""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return f"{message.get('role', '')}:{content or ''}\n"


COMPLETIONS_MAX_TOKENS = 16
"""What /v1/completions generates without max_tokens (OpenAI's default, and SGLang's): load counted as /generate's
default of 128 made such a request weigh eight times its size."""


def routing_body(route: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """`body` as the policies read it."""
    if route == "/generate":
        return body
    params: dict[str, Any] = {}
    budget = body.get("max_completion_tokens") or body.get("max_tokens")
    if budget is None and route == "/v1/completions":
        budget = COMPLETIONS_MAX_TOKENS
    if isinstance(budget, int):
        params["max_new_tokens"] = budget
    if isinstance(body.get("n"), int):
        params["n"] = body["n"]
    view: dict[str, Any] = {"sampling_params": params}
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        view["text"] = "".join(_message_text(m) for m in messages) if isinstance(messages, list) else ""
        return view
    prompt = body.get("prompt")
    is_ids = isinstance(prompt, list) and prompt and (isinstance(prompt[0], int) or isinstance(prompt[0], list))
    view["input_ids" if is_ids else "text"] = prompt
    return view
