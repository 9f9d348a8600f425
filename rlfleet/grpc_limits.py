"""Message-size limits of every gRPC server and channel in rlfleet, set in this one place.

gRPC refuses a larger message with RESOURCE_EXHAUSTED before any handler sees it. The default fits
the largest message rlfleet sends over gRPC (a RunSpec, a Run with its evaluations, a StepReport) with
room to spare; the reward hub passes its own `max_request_bytes`.

Only what a side receives is limited: a server's requests, a channel's responses. A limit on what it
sends would refuse a reply after the work is done (the reward hub's scores for a large batch), and the
receiving side guards itself anyway.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_CLIENT_RECEIVE_BYTES = 4 * 1024 * 1024
"""What a gRPC client receives unless it is told otherwise (grpcurl, the generated clients of every language): an
answer meant for any client stays under it, whatever rlfleet's own channels would take."""


def message_size_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for `aio.server(options=...)` and `aio.insecure_channel(options=...)`: the largest message received."""
    return [("grpc.max_receive_message_length", max_bytes)]
