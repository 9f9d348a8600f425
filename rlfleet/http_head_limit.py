"""A bound on a request's head (request line and headers), before the server buffers it: 431 past it.

uvicorn's httptools protocol keeps no bound of its own: the parser gathers a header as it arrives, so one
request with a 256 MiB header, sent before any token or body limit can look at it (both need the whole head),
held half a gigabyte of a service's memory, and the router's event loop for seconds. Every service serves
HTTP with this protocol (`uvicorn.Config(..., http=HeadLimitedHttpProtocol)`); the router's own protocol
extends it. The bound is on the bytes read before the head's blank line, as nginx's and Node's are.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
_HEAD_END = b"\r\n\r\n"


def _refusal() -> bytes:
    message = f"the request line and headers are over {MAX_HEAD_BYTES} bytes"
    body = json.dumps({"error": {"kind": "resource_exhausted", "message": message, "code": 431}}).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


_REFUSAL = _refusal()


class HeadLimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering 431 and closing the connection once a head passes MAX_HEAD_BYTES.

    A head is counted in the reads from the connection's start, or from the one after the read its request began
    in, to its blank line; a request's body is not counted. A subclass that does not
    call this on_headers_complete calls `end_head` instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""  # the last bytes of the head so far: its blank line may span two reads

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            seen = self._tail + data
            end = seen.find(_HEAD_END)
            if end < 0:
                self._head_bytes += len(data)
                self._tail = seen[-(len(_HEAD_END) - 1) :]
            else:
                self._head_bytes += end + len(_HEAD_END) - len(self._tail)
            if self._head_bytes > MAX_HEAD_BYTES:
                logger.warning("refused a request from %s: its head passed %d bytes", self.client, MAX_HEAD_BYTES)
                self.transport.write(_REFUSAL)
                self.transport.close()
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes, self._tail = 0, b""

    def end_head(self) -> None:
        self._in_head = False

    def on_headers_complete(self) -> None:
        self.end_head()
        super().on_headers_complete()
