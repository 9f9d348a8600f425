"""The hub's HTTP listening socket, bound before the workers start so that a taken port fails fast.

`socket.create_server` leaves the socket's protocol field at 0, and every accepted connection copies
it; asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say IPPROTO_TCP. Without
it a response's headers and body leave in two segments and the second waits for the client's delayed
ACK: about 40 ms on every keep-alive request, longer than scoring a small batch.
"""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) whose accepted connections asyncio sets to TCP_NODELAY."""
    listener = socket.create_server((host, port))
    return socket.socket(listener.family, listener.type, socket.IPPROTO_TCP, fileno=listener.detach())
