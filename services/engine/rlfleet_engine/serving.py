"""Serving the engine's HTTP app until SIGTERM or SIGINT, with a bounded shutdown.

Uvicorn stops on a signal once every connection has closed. A request the engine holds (while it is paused, or
generating a long answer) keeps its connection open, so the engine never stopped: a paused engine that a router
restarts was killed by its launcher's timeout, and its clients saw a reset connection. On a signal the engine now
lets what it runs go on for SHUTDOWN_DRAIN_S, then aborts every request it still holds, each answered with finish
reason `abort` and the tokens it has, as `/abort_request` answers it; connections still open SHUTDOWN_GRACE_S after
the signal (a client that does not read) are closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from rlfleet.http_head_limit import HeadLimitedHttpProtocol
from rlfleet_engine.config import EngineConfig

logger = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 4.0
SHUTDOWN_GRACE_S = 5


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, abort_all: Callable[[], None]) -> None:
        super().__init__(config)
        self._abort_all = abort_all
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            # A signal handler interrupts the loop anywhere: the abort runs as a callback of its own.
            self._loop.call_soon_threadsafe(self._loop.call_later, SHUTDOWN_DRAIN_S, self._abort_held)
        super().handle_exit(sig, frame)

    def _abort_held(self) -> None:
        logger.info("shutting down: aborting the requests still held %.0f s after the signal", SHUTDOWN_DRAIN_S)
        self._abort_all()


def serve_http(app: FastAPI, config: EngineConfig, abort_all: Callable[[], None]) -> None:
    """Serves `app` on the configured address until a signal stops it (see the module docstring);
    `abort_all()` aborts every request the engine holds, paused or not."""
    # log_config=None keeps the handlers init_logging installed.
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        http=HeadLimitedHttpProtocol,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    _Server(server_config, abort_all).run()
