"""HTTP/2 keepalive of gRPC servers with long-lived streams (a run's Watch can be quiet for hours).

The server pings a connection idle for `every_s`, which keeps proxies and NAT tables from dropping it and
frees the stream of a client that vanished without closing it. Clients that ping to notice a vanished
server (the way to bound an idle stream without cutting it with a deadline) are allowed to, as often as
every third of `every_s`: gRPC's default would answer a client pinging more often than every 5 minutes
with GOAWAY "too_many_pings", ending its watch with UNAVAILABLE.
"""

from __future__ import annotations

PING_TIMEOUT_S = 10.0
"""A ping not answered this long closes the connection."""


def server_keepalive_options(every_s: float) -> list[tuple[str, int]]:
    """Options for `aio.server(options=...)`."""
    every_ms, timeout_ms = int(every_s * 1000), int(PING_TIMEOUT_S * 1000)
    return [
        ("grpc.keepalive_time_ms", every_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Without this the server stops pinging after 2 pings on a stream that sends no data: a quiet Watch.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", every_ms // 3),
        ("grpc.http2.min_ping_interval_without_data_ms", every_ms // 3),
    ]


def channel_keepalive_options(every_s: float) -> list[tuple[str, int]]:
    """Options for a client channel that pings an idle connection every `every_s` (at least a third of the
    server's own `every_s`) and fails its calls with UNAVAILABLE when a ping is not answered."""
    return [
        ("grpc.keepalive_time_ms", int(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
    ]
