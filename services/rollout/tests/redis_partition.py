"""A TCP proxy in front of the shared Redis that a test can cut, as a network partition cuts one orchestrator
off Redis while the others still reach it: while cut, nothing passes either way (what arrives is held, and
passed on once healed); a connection its client closes meanwhile is closed without passing what it held."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlparse

# How often a held connection looks whether the cut is over.
_LOOK_EVERY_S = 0.02


class RedisPartition:
    """`url` reaches `redis_url` through the proxy; `cut()` and `heal()` toggle the partition; `close()` stops it."""

    def __init__(self, redis_url: str) -> None:
        target = urlparse(redis_url)
        self._target = (target.hostname or "127.0.0.1", target.port or 6379)
        self._path = target.path or "/0"
        self.port = 0
        self.url = ""
        self._cut = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy to Redis did not start within 10 s")

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self.heal()
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout=10)

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}{self._path}"
        self._ready.set()
        async with server:
            await self._stopped.wait()
            server.close()

    async def _connect(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        while self._cut.is_set():  # a connection made while cut is not answered until healed
            await asyncio.sleep(_LOOK_EVERY_S)
        try:
            redis_in, redis_out = await asyncio.open_connection(*self._target)
        except OSError:
            client_out.close()
            return
        await asyncio.gather(self._pass(client_in, redis_out), self._pass(redis_in, client_out))

    async def _pass(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        held = bytearray()
        try:
            while True:
                if held and not self._cut.is_set():
                    sink.write(bytes(held))
                    held.clear()
                    await sink.drain()
                try:
                    async with asyncio.timeout(_LOOK_EVERY_S):
                        data = await source.read(65536)
                except TimeoutError:
                    continue
                if not data:  # closed: what it held is passed on only if not cut
                    if held and not self._cut.is_set():
                        sink.write(bytes(held))
                        await sink.drain()
                    return
                held += data
        except (ConnectionError, OSError):
            return
        finally:
            with contextlib.suppress(Exception):
                sink.close()
