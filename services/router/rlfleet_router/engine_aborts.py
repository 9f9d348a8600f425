"""Asking an engine to stop a request the router gave up on: `POST /abort_request` by the request's rid.

The router forwards a request's bytes unchanged, so it knows the request at the engine by the `rid` its
client gave (one, or one per prompt of a batch, as the orchestrator sends). The router also closes the
request's connection, which SGLang takes as an abort too, but only when it next looks (every few
seconds for a plain request) and rlfleet-engine not at all for a plain request; the abort by rid stops
the generation at once. A request without a rid is stopped by the closed connection alone.

Best effort, off the request's path: the aborts run in the background, each bounded, and the first that
fails (a hung or dead engine) ends the others to that engine.
"""

from __future__ import annotations

import asyncio
import json
import logging

from rlfleet_router.engine_client import EngineClient, EngineConnectionError, EngineReadTimeout
from rlfleet_router.weights import describe_error

logger = logging.getLogger(__name__)

# An abort goes to an engine that may be hung: it must not outlive the need for it by much.
ABORT_TIMEOUT_SECS = 2.0
JSON_HEADERS = {"content-type": "application/json"}


def request_rids(body: bytes) -> list[str]:
    """The rids a generation request's body names (`rid`: a string or a list of them); none if it names none."""
    try:
        rid = json.loads(body).get("rid") if body else None
    except (ValueError, AttributeError):  # not JSON, or not an object
        return []
    if isinstance(rid, str):
        return [rid] if rid else []
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str) and r]
    return []


class EngineAborts:
    def __init__(self, timeout_secs: float = ABORT_TIMEOUT_SECS) -> None:
        self._timeout = timeout_secs
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, client: EngineClient, engine_url: str, body: bytes, why: str) -> None:
        """Asks `engine_url` to abort the request whose body is `body`, if it names its rid; returns at once."""
        rids = request_rids(body)
        if not rids:
            return
        task = asyncio.get_running_loop().create_task(self._abort(client, engine_url, rids, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, timeout_secs: float = 5.0) -> None:
        """Stops the aborts still under way (bounded)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_secs)

    async def _abort(self, client: EngineClient, engine_url: str, rids: list[str], why: str) -> None:
        for rid in rids:
            body = json.dumps({"rid": rid}).encode()
            try:
                answer = await client.request(
                    "POST", engine_url, "/abort_request", body, JSON_HEADERS, self._timeout, self._timeout
                )
                try:
                    await answer.read()
                except BaseException:
                    answer.close()
                    raise
                answer.release()
            except (EngineConnectionError, EngineReadTimeout) as exc:
                logger.info("could not ask %s to abort %s (%s): %s", engine_url, rid, why, describe_error(exc))
                return
            logger.debug("asked %s to abort %s (%s): HTTP %d", engine_url, rid, why, answer.status)
