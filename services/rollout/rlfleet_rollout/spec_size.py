"""The largest run spec the orchestrator takes: the Run that holds it must reach any gRPC client.

Get, List and Watch answer with the Run, its spec included, and Submit with the Run it stored. A gRPC client receives
at most 4 MiB unless told otherwise (grpcurl, the generated clients of every language), while the server takes
Submits of up to MAX_MESSAGE_BYTES (16 MiB): a larger spec was stored, and its run then reached no such client, the
Submit's own answer included (RESOURCE_EXHAUSTED on the client's side, for a run that was stored). A spec is refused
at submit instead, alike over gRPC and REST, naming its size, the limit and its largest part. Runs hold no prompts of
their own: a large part is data (a reward term's params, say) that belongs in the dataset the orchestrator reads.
"""

from __future__ import annotations

from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct

from rlfleet.errors import InvalidInput
from rlfleet.grpc_limits import DEFAULT_CLIENT_RECEIVE_BYTES
from rlfleet.v1.runs_pb2 import RunSpec

MAX_SPEC_BYTES = 1024 * 1024
"""A quarter of what a default client receives: the rest of the Run grows while it runs (an EvalResult of under
100 bytes per evaluation, the trainer's metrics, an error), and a Watch's RunEvent adds its message."""
_MIB = 1024 * 1024


def require_spec_fits(spec: RunSpec) -> None:
    """InvalidInput naming the size of `spec` (serialized, as stored) and its largest part when it passes
    MAX_SPEC_BYTES."""
    size = spec.ByteSize()
    if size <= MAX_SPEC_BYTES:
        return
    part, part_size = largest_part(spec)
    raise InvalidInput(
        f"spec: {size / _MIB:.2f} MiB ({size} bytes) serialized, and a run spec may be at most "
        f"{MAX_SPEC_BYTES // _MIB} MiB, so that its run, which Submit, Get, List and Watch answer with, fits the "
        f"{DEFAULT_CLIENT_RECEIVE_BYTES // _MIB} MiB a gRPC client receives by default; largest part: {part} "
        f"({part_size / _MIB:.2f} MiB). Data per prompt belongs in the dataset, which the orchestrator reads from its "
        "storage: a column of dataset.jsonl, parquet or hf_disk, named in metadata_columns, reaches the reward "
        "functions with each prompt"
    )


def largest_part(message: Message, path: str = "") -> tuple[str, int]:
    """The path (as submit's errors name fields: `reward.terms[0].params.rubric`) and serialized size of the largest
    part of `message`, followed down through its largest field: into a message, a repeated message's largest element
    and a Struct's largest entry; a scalar, a list of scalars or a map ends it."""
    if isinstance(message, Struct):
        if not message.fields:
            return path, message.ByteSize()
        key = max(message.fields, key=lambda k: message.fields[k].ByteSize())
        return f"{path}.{key}", message.fields[key].ByteSize()
    # A field's size is what clearing it takes off the message's: exact, whatever its kind.
    rest = type(message)()
    rest.CopyFrom(message)
    sizes = {}
    before = rest.ByteSize()
    for field, _ in message.ListFields():
        rest.ClearField(field.name)
        after = rest.ByteSize()
        sizes[field.name] = before - after
        before = after
    if not sizes:
        return path, message.ByteSize()
    name = max(sizes, key=lambda n: sizes[n])
    field = message.DESCRIPTOR.fields_by_name[name]
    named = f"{path}.{name}" if path else name
    value = getattr(message, name)
    if field.message_type is None or field.message_type.GetOptions().map_entry:
        return named, sizes[name]
    if field.is_repeated:
        index = max(range(len(value)), key=lambda i: value[i].ByteSize())
        return largest_part(value[index], f"{named}[{index}]")
    return largest_part(value, named)
