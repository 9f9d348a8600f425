"""Asking an engine to stop a request the router gave up on: `POST /abort_request` by the request's rid.

The router forwards a request's bytes unchanged, so it knows the request at the engine by the `rid` its
client gave (one, or one per prompt of a batch, as the orchestrator sends). The router also closes the
request's connection, which SGLang takes as an abort too, but only when it next looks (every few
seconds for a plain request) and rlfleet-engine not at all for a plain request; the abort by rid stops
the generation at once. A request without a rid is stopped by the closed connection alone.

SGLang aborts every request whose rid starts with the one named, so an abort of "run/1" would also stop
"run/10" of another client at that engine. A rid that another request under way there starts with is
not sent: the closed connection stops its request. Clients get targeted aborts with prefix-free rids.

Best effort, off the request's path: the aborts run in the background, each bounded, and the first that
fails (a hung or dead engine) ends the others to that engine. A retry of the request that goes back to the
same engine under the same rid (a one-engine fleet, or every engine tried) waits for them first (`settle`):
sent while the abort is under way, it could reach the engine first and be aborted by it, or be refused as a
duplicate of the request not yet aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping

from rlfleet_router.engine_attempts import Attempt, EngineAttempts
from rlfleet_router.engine_client import EngineClient, EngineConnectionError, EngineReadTimeout
from rlfleet_router.weights import describe_error
from rlfleet_router.workers import Worker

logger = logging.getLogger(__name__)

# An abort goes to an engine that may be hung: it must not outlive the need for it by much.
ABORT_TIMEOUT_SECS = 2.0
JSON_HEADERS = {"content-type": "application/json"}


def request_rids(body: Mapping[str, object]) -> tuple[str, ...]:
    """The rids a generation request's body names (`rid`: a string or a list of them); none if it names none."""
    rid = body.get("rid")
    if isinstance(rid, str):
        return (rid,) if rid else ()
    if isinstance(rid, list):
        return tuple(r for r in rid if isinstance(r, str) and r)
    return ()


class EngineAborts:
    def __init__(self, attempts: EngineAttempts, timeout_secs: float = ABORT_TIMEOUT_SECS) -> None:
        self._attempts = attempts
        self._timeout = timeout_secs
        self._tasks: dict[asyncio.Task[None], Attempt] = {}  # the aborts under way, by the attempt each ends

    def send(self, client: EngineClient, attempt: Attempt, why: str) -> None:
        """Asks the engine of `attempt`, ended, to abort its request by the rids it names, if any; returns at once."""
        if not attempt.rids:
            return
        task = asyncio.get_running_loop().create_task(self._abort(client, attempt.worker, attempt.rids, why))
        self._tasks[task] = attempt
        task.add_done_callback(self._forget)

    async def settle(
        self,
        worker: Worker,
        rids: tuple[str, ...],
        timeout_secs: float,
        stops: Iterable[asyncio.Future[None]] = (),
    ) -> None:
        """Returns once the aborts under way at `worker` of any of `rids` are over, once one of `stops` is done (the
        request no longer waits: its client left, or aborted it), or after `timeout_secs`."""
        wanted = set(rids)
        pending: set[asyncio.Future[None]] = {
            t for t, a in self._tasks.items() if a.worker.id == worker.id and wanted.intersection(a.rids)
        }
        stops = set(stops)
        deadline = time.monotonic() + timeout_secs
        while pending and not any(stop.done() for stop in stops):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            _, pending = await asyncio.wait(pending | stops, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending -= stops

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def close(self, timeout_secs: float = 5.0) -> None:
        """Stops the aborts still under way (bounded)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_secs)

    async def _abort(self, client: EngineClient, worker: Worker, rids: tuple[str, ...], why: str) -> None:
        engine_url = worker.url
        for rid in rids:
            # Looked up as each abort goes out: a retry of this request at the same engine, under the same rid, is
            # one of the requests it must spare.
            spared = [other for other in self._attempts.rids_at(worker) if other.startswith(rid)]
            if spared:
                logger.debug(
                    "not asking %s to abort %s (%s): SGLang would abort %s under way there too, as their rids start "
                    "with it; the closed connection stops the request",
                    engine_url,
                    rid,
                    why,
                    ", ".join(spared),
                )
                continue
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
