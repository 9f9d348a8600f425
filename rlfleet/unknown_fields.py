"""Refusing a protobuf message that holds fields its type does not have.

A message sent by a peer built from a newer .proto (a client, or another service of a newer release) may hold
fields this process's generated code lacks. protobuf keeps them aside as unknown and the code reads the message
without them: a Submit would start a run without the option asked for, a List list every run as if it had
filtered, a trainer train a run without a setting its orchestrator sent. Every gRPC service refuses such a
request instead (rlfleet.grpc_errors decodes requests with this check), as the REST APIs refuse a name they do
not know.
"""

from __future__ import annotations

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from rlfleet.errors import InvalidInput


def require_known_fields(message: Message, path: str = "") -> None:
    """InvalidInput naming the first field, by number (its only name on the wire), that `message` (at `path`) or a
    message it holds has and its type does not."""
    unknown = sorted({field.field_number for field in unknown_fields.UnknownFieldSet(message)})
    if unknown:
        descriptor = message.DESCRIPTOR
        numbers = ", ".join(str(n) for n in unknown)
        known = ", ".join(f"{f.name} = {f.number}" for f in descriptor.fields)
        where = f"{path}: " if path else ""
        raise InvalidInput(
            f"{where}no field numbered {numbers} in {descriptor.full_name} (its fields: {known}); was the sender "
            f"built from a newer {descriptor.file.name}? This service would ignore it: leave it out, or upgrade "
            "the service"
        )
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    require_known_fields(item, f"{name}.{key}")
        elif field.is_repeated:
            for i, item in enumerate(value):
                require_known_fields(item, f"{name}[{i}]")
        else:
            require_known_fields(value, name)
