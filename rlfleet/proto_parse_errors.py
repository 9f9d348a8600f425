"""protobuf's JSON parse errors said the way a spec file and a JSON body spell their fields."""

from __future__ import annotations

import re

_NESTED = re.compile(r"Failed to parse (\w+) field: ")
_UNKNOWN = re.compile(r'Message type "([\w.]+)" has no field named "([^"]+)"')
_AVAILABLE = re.compile(r"Available Fields\(except extensions\): \"\[(.*)\]\"")


def describe_parse_error(message: str, root: str) -> str:
    """protobuf's nested "Failed to parse a field: Failed to parse b field: ..." as `a.b: ...` (`root` when the
    error is at the top), with an unknown field's siblings as snake_case names (`group_size`, not protobuf's
    JSON `groupSize`): what the proto files, the docs and the examples write."""
    path = []
    while match := _NESTED.match(message):
        path.append(match.group(1))
        message = message[match.end() :]
    if unknown := _UNKNOWN.match(message):
        path.append(unknown.group(2))
        available = _AVAILABLE.search(message)
        known = [_snake_case(name.strip(" '")) for name in available.group(1).split(",")] if available else []
        message = f"unknown field of {unknown.group(1)}" + (f" (its fields: {', '.join(known)})" if known else "")
    return f"{'.'.join(path) or root}: {message.strip().rstrip('.')}"


def _snake_case(json_name: str) -> str:
    return re.sub(r"([A-Z])", lambda upper: "_" + upper.group(1).lower(), json_name)
