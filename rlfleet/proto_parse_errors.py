"""protobuf JSON (a spec file, a request body) parsed into a message, with errors said the way a spec file and a
JSON body spell their fields.

Before protobuf sees the data, every message-typed field is checked to hold a mapping (a repeated one: a list
of mappings), at any depth: protobuf reads a string where a message belongs as the string's characters, each
an unknown field (`model: /some/path` became `model./: unknown field of rlfleet.v1.ModelSpec`). A float or double
field is checked not to hold true or false, which protobuf reads as 1.0 or 0.0 (`learning_rate: true` was a
learning rate of 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from rlfleet.errors import InvalidInput

M = TypeVar("M", bound=Message)

_NESTED = re.compile(r"Failed to parse (\w+) field: ")
_UNKNOWN = re.compile(r'Message type "([\w.]+)" has no field named "([^"]+)"')
_AVAILABLE = re.compile(r"Available Fields\(except extensions\): \"\[(.*)\]\"")
_STRUCT = "google.protobuf.Struct"
_FLOATING = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT})


def parse_json_message(data: Mapping[str, Any], message: M, root: str) -> M:
    """`data` parsed into `message` (returned); InvalidInput naming the field (`root` for the whole) otherwise."""
    if problem := misshapen_field(data, message.DESCRIPTOR):
        raise InvalidInput(problem)
    try:
        return json_format.ParseDict(data, message)
    except json_format.ParseError as exc:
        raise InvalidInput(describe_parse_error(str(exc), root)) from None
    except OverflowError:  # an integer beyond a double where protobuf wants one (JSON numbers are unbounded)
        where = _oversized_number(data) or root
        raise InvalidInput(f"{where}: a number too large (a double holds at most about 1.8e308)") from None


def _oversized_number(value: Any, path: str = "") -> str | None:
    """The path of the first integer in `value` that no double can hold, if any."""
    if isinstance(value, Mapping):
        items: list[tuple[str, Any]] = [(f"{path}.{key}" if path else str(key), item) for key, item in value.items()]
    elif isinstance(value, list):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            return path
        return None
    else:
        return None
    return next((found for where, item in items if (found := _oversized_number(item, where))), None)


def misshapen_field(data: Mapping[str, Any], descriptor: Descriptor, path: str = "") -> str | None:
    """`reward.terms[0]: expected a mapping (such as {function: ...}), got a string` for the first field of `data`
    (a `descriptor` message) that should hold a mapping, or a list of mappings, and does not; None when each
    does, or for a float or double field holding true or false. Unknown names and other scalar values are
    protobuf's to judge."""
    fields = {name: field for field in descriptor.fields for name in (field.json_name, field.name)}
    for key, value in data.items():
        field = fields.get(key)
        if field is None or value is None:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.message_type is None:
            if field.type in _FLOATING and any(
                isinstance(v, bool) for v in (value if isinstance(value, list) else [value])
            ):
                return f"{name}: expected a number, got true or false"
            continue
        if field.is_repeated and not field.message_type.GetOptions().map_entry:
            if not isinstance(value, list):
                example = _example(field.message_type)
                return f"{name}: expected a list of mappings (such as [{example}]), got {_kind(value)}"
            items = [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        else:
            items = [(name, value)]
        for where, item in items:
            if problem := _misshapen_message(item, field.message_type, where):
                return problem
    return None


def _misshapen_message(value: Any, descriptor: Descriptor, path: str) -> str | None:
    """What is wrong with `value` as the message `descriptor` (at `path`), if anything we check."""
    if descriptor.GetOptions().map_entry:  # a map<..., ...> field: a mapping whose values may be messages
        if not isinstance(value, Mapping):
            return f"{path}: expected a mapping, got {_kind(value)}"
        inner = descriptor.fields_by_name["value"].message_type
        for key, item in value.items() if inner is not None else ():
            if problem := _misshapen_message(item, inner, f"{path}.{key}"):
                return problem
        return None
    well_known = descriptor.full_name.startswith("google.protobuf.")
    if well_known and descriptor.full_name != _STRUCT:  # a Value, a wrapper, a Timestamp: not spelt as mappings
        return None
    if not isinstance(value, Mapping):
        example = "" if well_known else f" (such as {_example(descriptor)})"
        return f"{path}: expected a mapping{example}, got {_kind(value)}"
    return None if well_known else misshapen_field(value, descriptor, path)


def _example(descriptor: Descriptor) -> str:
    """`{path: ...}`: the message's first field, as a spec file spells it."""
    return f"{{{descriptor.fields[0].name}: ...}}" if descriptor.fields else "{}"


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "a mapping" if isinstance(value, Mapping) else type(value).__name__


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
