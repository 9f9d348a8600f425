"""Control requests sent to every engine at once: abort, pause, continue, flush the cache.

The body, a JSON object or nothing, goes to each engine as it arrived, under a JSON Content-Type
whatever the client called it (`curl -d` calls it form data, which an engine would not read). The
answer lists each engine's outcome; it is 200 only if every engine answered 2xx, 400 if every failing
engine refused the request as malformed (4xx: the caller's fault, and retrying will not help), else 502
with the failures, so a caller never mistakes a partial pause for a fleet-wide one; 503 with no engine
in the fleet, since nothing was paused, aborted or flushed. Engines out of routing get the request too
(an abort or a pause must reach an engine that still runs requests while it is drained), and their
failures are reported the same way.

Generation must not continue on an engine holding part of a weight version (some buckets of a version
sent over a weight update group, not its last): `before_continue` takes such engines out of routing
first, whoever ends the pause: a /continue_generation relayed from the trainer (a new trainer's first
one, after the last died mid-version), or the router's own once a pause outlived its bound (`end_pauses`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx
from prometheus_client import Counter

from rlfleet.errors import Unavailable
from rlfleet_router.busy_engines import BusyEngines
from rlfleet_router.proxy import forwardable_headers
from rlfleet_router.weights import describe_error
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

FANOUT_ROUTES = ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache")
CONTINUE_ROUTE = "/continue_generation"


@dataclass(frozen=True)
class EngineOutcome:
    worker: Worker
    status: int | None  # None: no answer (connection error or timeout)
    message: str

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def describe(self) -> dict[str, object]:
        return {"id": self.worker.id, "url": self.worker.url, "status": self.status, "message": self.message}


class Fanout:
    def __init__(
        self,
        client: httpx.AsyncClient,
        workers: WorkerRegistry,
        timeout_secs: float,
        on_caches_emptied: Callable[[list[Worker]], None],
        busy: BusyEngines,
        before_continue: Callable[[], None],
        expired_pauses: Counter,
    ) -> None:
        """`on_caches_emptied(workers)` runs with the engines that answered a /flush_cache with 2xx; `busy` learns
        which engines are paused (their generation probes wait until /continue_generation); `before_continue()`
        runs before any /continue_generation is sent; `expired_pauses` counts the engines `end_pauses` resumed."""
        self._client = client
        self._workers = workers
        self._timeout = timeout_secs
        self._on_caches_emptied = on_caches_emptied
        self._busy = busy
        self._before_continue = before_continue
        self._expired_pauses = expired_pauses

    async def send(self, route: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, object]]:
        """Sends `route` to every engine; returns the HTTP status of the whole and the per-engine outcomes."""
        assert route in FANOUT_ROUTES, route
        workers = self._workers.all()
        if not workers:
            raise Unavailable(f"{route}: no engine in the fleet; add one with POST /workers")
        forwarded = {k: v for k, v in forwardable_headers(headers).items() if k.lower() != "content-type"}
        if body.strip():
            forwarded["content-type"] = "application/json"
        if route == "/pause_generation":
            self._busy.pause(workers)  # before it lands: a probe sent meanwhile would wait behind it
        elif route == CONTINUE_ROUTE:
            self._before_continue()
        outcomes = await asyncio.gather(*(self._one(w, route, body, forwarded) for w in workers))
        if route == "/flush_cache":
            self._on_caches_emptied([o.worker for o in outcomes if o.ok])
        elif route in ("/pause_generation", CONTINUE_ROUTE):
            # Whatever a continue's answer, the pause ends for the router: an engine still paused fails its probes.
            self._busy.resume([o.worker for o in outcomes if route == CONTINUE_ROUTE or not o.ok])
        ok = all(o.ok for o in outcomes)
        done = sum(o.ok for o in outcomes)
        summary = {
            "success": ok,
            "message": f"{route}: {done}/{len(outcomes)} engines answered 2xx",
            "engines": [o.describe() for o in outcomes],
        }
        if ok:
            return 200, summary
        refused = [o for o in outcomes if not o.ok]
        return (400 if all(o.status is not None and 400 <= o.status < 500 for o in refused) else 502), summary

    async def end_pauses(self, workers: list[Worker]) -> None:
        """Sends /continue_generation to `workers`, whose pause outlived its bound: whoever paused them (a trainer
        that died between /pause_generation and /continue_generation, or whose continue was lost) cannot be
        waited for any longer, or their generation stalls for good."""
        logger.warning(
            "engines %s paused for longer than a weight load may take without /continue_generation: continuing "
            "generation on them",
            [w.url for w in workers],
        )
        self._expired_pauses.inc(len(workers))
        self._before_continue()
        outcomes = await asyncio.gather(
            *(self._one(w, CONTINUE_ROUTE, b"{}", {"content-type": "application/json"}) for w in workers)
        )
        for outcome in outcomes:
            if not outcome.ok:
                logger.warning(
                    "engine %s did not take /continue_generation (%s %s); it fails its probes while it stays paused",
                    outcome.worker.url,
                    outcome.status,
                    outcome.message,
                )

    async def _one(self, worker: Worker, route: str, body: bytes, headers: dict[str, str]) -> EngineOutcome:
        try:
            response = await self._client.post(
                f"{worker.url}{route}", content=body, headers=headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            return EngineOutcome(worker, None, describe_error(exc))
        return EngineOutcome(worker, response.status_code, response.text[:200])
