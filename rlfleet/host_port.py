"""`host:port` as gRPC's bind and target strings and URLs take it: an IPv6 address in brackets.

`--host ::` or `--host ::1` written as f"{host}:{port}" gives `:::50052`, which gRPC refuses to bind (and a URL
reads as something else); `[::]:50052` is what it means. A host name or an IPv4 address never holds a ':'.
"""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """`host:port`, with `host` in brackets when it is an IPv6 address (one already in brackets is kept as is)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"
