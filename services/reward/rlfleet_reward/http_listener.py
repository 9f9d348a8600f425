"""The hub's HTTP listening socket, bound before the workers start so that a taken port fails fast.

`socket.create_server` leaves the socket's protocol field at 0, and every accepted connection copies
it; asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say IPPROTO_TCP. Without
it a response's headers and body leave in two segments and the second waits for the client's delayed
ACK: about 40 ms on every keep-alive request, longer than scoring a small batch.

`socket.create_server` binds IPv4 unless told otherwise, so an IPv6 host (one holding a ':', with or without
brackets) asks for AF_INET6; `::` also takes IPv4 connections where the system allows both on one socket,
as `0.0.0.0` would.
"""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) whose accepted connections asyncio sets to TCP_NODELAY."""
    if ":" in host:
        address = host.removeprefix("[").removesuffix("]")
        dualstack = address == "::" and socket.has_dualstack_ipv6()
        listener = socket.create_server((address, port), family=socket.AF_INET6, dualstack_ipv6=dualstack)
    else:
        listener = socket.create_server((host, port))
    return socket.socket(listener.family, listener.type, socket.IPPROTO_TCP, fileno=listener.detach())
