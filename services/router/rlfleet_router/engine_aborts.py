"""Asking an engine to stop a request the router gave up on: `POST /abort_request` by the request's rid.

The router forwards a request's bytes unchanged, so it knows the request at the engine by the `rid` its
client gave (one, or one per prompt of a batch, as the orchestrator sends). The router also closes the
request's connection, which SGLang takes as an abort too, but only when it next looks (every few
seconds for a plain request) and rlfleet-engine not at all for a plain request; the abort by rid stops
the generation at once. A request without a rid is stopped by the closed connection alone.

SGLang aborts every request whose rid starts with the one named, so an abort of "run/1" would also stop
"run/10" of another client at that engine. A rid that another request under way there starts with is
not sent: the closed connection stops its request. Clients get targeted aborts with prefix-free rids.

The router also asks an engine to abort rids of a request still under way there on its client's behalf
(`send_at`): a client's /abort_request that may have reached the engine before the request, or that named part of
a batch before it was sent (see `held_requests`).

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
from collections.abc import Coroutine, Iterable, Mapping

from prometheus_client import Counter

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
    def __init__(
        self, attempts: EngineAttempts, timeout_secs: float = ABORT_TIMEOUT_SECS, resent: Counter | None = None
    ) -> None:
        """`resent` counts the rids `send_at` sends."""
        self._attempts = attempts
        self._timeout = timeout_secs
        self._resent = resent
        # The aborts under way (or waiting for their time): the engine and the rids of each.
        self._tasks: dict[asyncio.Task[None], tuple[str, tuple[str, ...]]] = {}

    def send(self, client: EngineClient, attempt: Attempt, why: str) -> None:
        """Asks the engine of `attempt`, ended, to abort its request by the rids it names, if any; returns at once."""
        if attempt.rids:
            self._start(self._abort(client, attempt, attempt.rids, why), attempt.worker, attempt.rids)

    def send_at(self, client: EngineClient, attempt: Attempt, rids: tuple[str, ...], at: float, why: str) -> None:
        """Asks the engine of `attempt` to abort `rids`, some of its own, at `at` (time.monotonic()) if the attempt is
        still under way then; returns at once."""
        if rids:
            self._start(self._abort_later(client, attempt, rids, at, why), attempt.worker, rids)

    def _start(self, abort: Coroutine[None, None, None], worker: Worker, rids: tuple[str, ...]) -> None:
        task = asyncio.get_running_loop().create_task(abort)
        self._tasks[task] = (worker.id, rids)
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
            task for task, (engine, aborting) in self._tasks.items() if engine == worker.id and wanted & set(aborting)
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

    async def _abort_later(
        self, client: EngineClient, attempt: Attempt, rids: tuple[str, ...], at: float, why: str
    ) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if not attempt.ended:
            if self._resent is not None:
                self._resent.inc(len(rids))
            await self._abort(client, attempt, rids, why)

    async def _abort(self, client: EngineClient, attempt: Attempt, rids: tuple[str, ...], why: str) -> None:
        """Aborts `rids` of `attempt` at its engine (the attempt ended, or still under way when it is not all of its
        rids that go)."""
        worker = attempt.worker
        engine_url = worker.url
        for rid in rids:
            # Looked up as each abort goes out: a retry of this request at the same engine, under the same rid, is
            # one of the requests it must spare, as are the attempt's own rids that stay.
            under_way = self._attempts.rids_at(worker, besides=attempt) + [r for r in attempt.rids if r not in rids]
            spared = [other for other in under_way if other.startswith(rid)]
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
