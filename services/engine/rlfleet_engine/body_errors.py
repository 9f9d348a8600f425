"""What a refused request body says, and which of SGLang's two refusals /generate gives it.

SGLang's /generate refuses a body in two places. FastAPI's validation of `GenerateReqInput` catches a top-level
field of the wrong type (or bad JSON) and answers 400 `{"object": "error", "message", ...}`; everything inside
`sampling_params` (a dict there) and the prompt's presence are checked later, in its tokenizer manager, whose
ValueError /generate answers 400 `{"error": {"message"}}`. This engine validates both at once, so it sorts a
refusal by where the problem lies to answer it in the shape SGLang would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Names pydantic gives the alternatives of a union in an error path (besides generic ones like `list[int]`).
_UNION_TAGS = frozenset({"str", "int", "float", "bool"})


def describe(errors: Sequence[Mapping[str, Any]]) -> str:
    """One clause per problem, naming the field (`body.sampling_params.top_p: ...`).

    Pydantic reports a failed union once per alternative, with the alternative's name in the path;
    those names are dropped, and of the alternatives only the most specific complaint per field is kept.
    """
    found: list[tuple[str, str]] = []
    for err in errors:
        if err.get("type") == "json_invalid":
            return (
                f"malformed JSON body: {err.get('ctx', {}).get('error', 'decode error')} at position {err['loc'][-1]}"
            )
        path = [str(p) for p in _plain_loc(err)]
        found.append((".".join(path), str(err.get("msg", "invalid")).removeprefix("Value error, ")))
    deepest = [(loc, msg) for loc, msg in found if not any(o != loc and o.startswith(loc + ".") for o, _ in found)]
    seen: dict[str, str] = {}
    for loc, msg in deepest:
        seen.setdefault(loc, msg)
    return "; ".join(f"{loc}: {msg}" for loc, msg in seen.items()) or "invalid request"


def refused_past_validation(body: object, errors: Sequence[Mapping[str, Any]]) -> bool:
    """Whether SGLang's /generate would refuse `body` past FastAPI's validation (in its `{"error": ...}` shape):
    every problem is a value inside well-formed `sampling_params` (an object, or a list of them) or the body's
    own rules (no prompt, or two; a field this engine cannot honour), none a top-level field of the wrong type."""
    if not isinstance(body, dict):
        return False
    params = body.get("sampling_params")
    each_an_object = isinstance(params, list) and all(isinstance(p, dict) for p in params)
    if not (params is None or isinstance(params, dict) or each_an_object):
        return False
    for err in errors:
        loc = _plain_loc(err)
        if loc == ("body",) and err.get("type") == "value_error":
            continue  # the body's own rules (GenerateRequest's model validators)
        if len(loc) < 2 or loc[1] != "sampling_params":
            return False
    return True


def _plain_loc(err: Mapping[str, Any]) -> tuple[object, ...]:
    return tuple(p for p in err.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
