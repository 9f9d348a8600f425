"""The HTTP server of a trainer node whose ranks all follow rank 0 (every pod but pod 0 in Kubernetes).

A follower's main thread is taken by `RankGroup.follow()`, so its node's /health and /metrics are
served from a thread beside it, for as long as the rank follows.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from rlfleet.http_head_limit import HeadLimitedHttpProtocol

logger = logging.getLogger(__name__)

_POLL_S = 0.05


@contextlib.contextmanager
def serving_in_thread(app: FastAPI, host: str, port: int, start_timeout_s: float = 30.0) -> Iterator[None]:
    """Serves `app` on host:port in a daemon thread while the block runs; stops it (bounded) after.

    The port is bound here, before the thread starts, so a taken port raises RuntimeError naming it at
    once: a node that cannot be probed would only be restarted by Kubernetes. Signals stay with the main
    thread (uvicorn handles them only there).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise RuntimeError(
            f"the trainer node's HTTP server (/health, /metrics) cannot listen on {host}:{port} "
            f"({exc.strerror or exc}); choose another port with --http-port"
        ) from exc
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, http=HeadLimitedHttpProtocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="node-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer node's HTTP server on {host}:{port} did not start")
            time.sleep(_POLL_S)
        logger.info("this node's HTTP (/health, /metrics) serves on %s:%d", host, port)
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
