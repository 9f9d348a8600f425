"""Control requests sent to every engine at once: abort, pause, continue, flush the cache.

The body, a JSON object or nothing, goes to each engine as it arrived, under a JSON Content-Type
whatever the client called it (`curl -d` calls it form data, which an engine would not read). The
answer lists each engine's outcome; it is 200 only if every engine answered 2xx, 400 if every failing
engine refused the request as malformed (4xx: the caller's fault, and retrying will not help), else 502
with the failures, so a caller never mistakes a partial pause for a fleet-wide one; 503 with no engine
in the fleet, since nothing was paused, aborted or flushed. Engines out of routing get the request too
(an abort or a pause must reach an engine that still runs requests while it is drained; a continue, one
that rejoined routing during the pause), and their failures are reported the same way. `FleetPause`
records each pause and continue, to bring the engines that enter routing later in line with them. A relayed
/abort_request also reaches the generation requests the router holds at that moment, at no engine (`abort_held`,
before the engines are asked: see `held_requests`).

Generation must not continue on an engine holding part of a weight version (some buckets of a version
sent over a weight update group, not its last), whoever ends the pause: a /continue_generation relayed
from the trainer (a new trainer's first one, after the last died mid-version), or the router's own once a
pause outlived its bound (`end_pauses`). `before_continue` takes such engines out of routing first and
names them; the requests each holds would resume on the mix and reach their clients under a version that
did not produce them. So before it is continued, the router stops waiting for them (`drop_requests`: as for
an engine that failed, the proxy sends a request none of whose answer has reached its client to another
engine under the same rid, and ends a stream under way with an error) and has the engine abort them all
(`ABORT_ALL`). An engine that does not take that abort is not continued: it stays paused, out of routing,
until it has loaded a whole version, and entering routing continues it then (`FleetPause.match`). Keeping
the requests held until such a load instead would hold them until their deadline if no version comes.

Nor may an engine that did not take the fleet's pause (an error, or no answer in time) be routed to while
the pause stands: the trainer sends a version in buckets behind it, and between two buckets such an engine
would answer with part of the new version loaded, under the old version's label. So once the answers to a
pause that some engine took are in, the engines in routing that did not take it are taken out of routing
(`WorkerRegistry.take_out`; requests already there finish there). As members of a weight update group out of
routing, they get no bucket (the router refuses one sent to such a group; the trainer opens the group again
with the engines in routing), and taking them out forgot the load they applied. They come back through
admission like any engine out of routing: holding the fleet's current load whole (loaded from its disk copy,
once registered, whatever they held) and in line with the fleet's pause (`FleetPause.match` sends them the
fleet's pause again while it stands; after the continue, they rejoin generating).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping

import httpx
from prometheus_client import Counter

from rlfleet.errors import Unavailable
from rlfleet_router.engine_controls import (
    ABORT_ALL,
    ABORT_ROUTE,
    CONTINUE_ROUTE,
    FLUSH_ROUTE,
    JSON_HEADERS,
    PAUSE_ROUTE,
    EngineOutcome,
    post_control,
)
from rlfleet_router.fleet_pause import FleetPause, Pause
from rlfleet_router.proxy import forwardable_headers
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

FANOUT_ROUTES = (ABORT_ROUTE, PAUSE_ROUTE, CONTINUE_ROUTE, FLUSH_ROUTE)


class Fanout:
    def __init__(
        self,
        client: httpx.AsyncClient,
        workers: WorkerRegistry,
        timeout_secs: float,
        on_caches_emptied: Callable[[list[Worker]], None],
        pauses: FleetPause,
        before_continue: Callable[[], list[Worker]],
        drop_requests: Callable[[Worker, str], None],
        expired_pauses: Counter,
        abort_held: Callable[[str | None], int] | None = None,
    ) -> None:
        """`on_caches_emptied(workers)` runs with the engines that answered a /flush_cache with 2xx; `pauses` learns
        of every pause and continue; `before_continue()` runs before any /continue_generation is sent and returns
        the engines that may hold part of a weight version; `drop_requests(worker, why)` makes the router stop
        waiting for the requests at `worker` (sending them elsewhere if it can); `expired_pauses` counts the
        engines `end_pauses` resumed; `abort_held(rid)` aborts the requests the router holds that `rid` names (None:
        all of them), for a relayed /abort_request."""
        self._client = client
        self._workers = workers
        self._timeout = timeout_secs
        self._on_caches_emptied = on_caches_emptied
        self._pauses = pauses
        self._before_continue = before_continue
        self._drop_requests = drop_requests
        self._expired_pauses = expired_pauses
        self._abort_held = abort_held

    async def send(
        self, route: str, body: bytes, headers: Mapping[str, str], query: str = ""
    ) -> tuple[int, dict[str, object]]:
        """Sends `route` (with its `query`, if any) to every engine; returns the HTTP status of the whole and the
        per-engine outcomes: 200 when every engine took it, 400 when none did and each refused it (4xx), else 502
        (some took it and some did not, or an engine failed or did not answer); Unavailable when no engine is in the
        fleet, before or once the answers are in (all removed meanwhile)."""
        assert route in FANOUT_ROUTES, route
        workers = self._workers.all()
        if not workers:
            raise Unavailable(f"{route}: no engine in the fleet; add one with POST /workers")
        forwarded = {k: v for k, v in forwardable_headers(headers).items() if k.lower() != "content-type"}
        if body.strip():
            forwarded["content-type"] = "application/json"
        if route == ABORT_ROUTE and self._abort_held is not None:
            self._abort_held_named(body)
        pause: Pause | None = None
        if route == CONTINUE_ROUTE:
            self._pauses.end()
            partial = {w.id for w in self._before_continue()}
            outcomes = self._members(
                await asyncio.gather(*(self._continue(w, body, forwarded, w.id in partial) for w in workers))
            )
        else:
            pause = self._pauses.begin(workers, body, forwarded) if route == PAUSE_ROUTE else None
            target = f"{route}?{query}" if query else route
            outcomes = self._members(await asyncio.gather(*(self._one(w, target, body, forwarded) for w in workers)))
            if pause is not None and not any(o.ok for o in outcomes):
                self._pauses.end(pause)  # no engine paused (a body they all refused): neither is the fleet
        if route == FLUSH_ROUTE:
            self._on_caches_emptied([o.worker for o in outcomes if o.ok])
        elif route in (PAUSE_ROUTE, CONTINUE_ROUTE):
            self._pauses.record(route, outcomes)
        if pause is not None and self._pauses.current(pause):
            self._take_out_unpaused(outcomes)
        if not outcomes:  # 0 of 0 is no success: nothing was paused, aborted or flushed
            raise Unavailable(f"{route}: every engine was removed from the fleet while it was asked; none took it")
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
        every_one_refused = done == 0 and all(o.status is not None and 400 <= o.status < 500 for o in refused)
        return (400 if every_one_refused else 502), summary

    def _abort_held_named(self, body: bytes) -> None:
        """Aborts the requests the router holds that an /abort_request `body` names, as SGLang reads it: `abort_all`
        true names every one, else `rid` the one it is exactly (an empty or missing rid names none)."""
        assert self._abort_held is not None
        request = json.loads(body) if body.strip() else {}  # a JSON object: the route checked it
        if not isinstance(request, dict):
            return
        rid = request.get("rid")
        if request.get("abort_all") is True:
            count = self._abort_held(None)
        elif isinstance(rid, str) and rid:
            count = self._abort_held(rid)
        else:
            return
        if count:
            logger.info("aborted %d request(s) the router held before sending them to an engine", count)

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
        partial = {w.id for w in self._before_continue()}
        outcomes = self._members(
            await asyncio.gather(*(self._continue(w, b"{}", JSON_HEADERS, w.id in partial) for w in workers))
        )
        self._pauses.record(CONTINUE_ROUTE, outcomes)
        for outcome in outcomes:
            if not outcome.ok:
                logger.warning(
                    "engine %s did not take /continue_generation (%s %s); it fails its probes while it stays paused",
                    outcome.worker.url,
                    outcome.status,
                    outcome.message,
                )

    async def _continue(self, worker: Worker, body: bytes, headers: Mapping[str, str], partial: bool) -> EngineOutcome:
        """Continues generation on `worker`; on one that may hold `partial` weights, only once none of the requests
        it holds can resume (see the module docstring)."""
        if partial:
            why = f"{worker.url} may hold part of a weight version: what it generates now mixes two versions"
            self._drop_requests(worker, why)
            aborted = await self._one(worker, ABORT_ROUTE, ABORT_ALL, JSON_HEADERS)
            if not aborted.ok:
                logger.warning(
                    "engine %s, which may hold part of a weight version, did not abort its requests (%s %s): not "
                    "continuing it; it stays paused until it has loaded a whole version",
                    worker.url,
                    aborted.status,
                    aborted.message,
                )
                return EngineOutcome(
                    worker,
                    None,
                    f"not continued: it may hold part of a weight version and did not take {ABORT_ROUTE} "
                    f"(abort_all) first ({aborted.status}: {aborted.message}); it continues once it loaded a whole one",
                )
        return await self._one(worker, CONTINUE_ROUTE, body, headers)

    def _take_out_unpaused(self, outcomes: list[EngineOutcome]) -> None:
        """Takes out of routing the engines in routing that did not take the fleet's pause (see the module
        docstring); the requests already there finish there, on the weights it holds."""
        for outcome in outcomes:
            worker = outcome.worker
            if outcome.ok or not (worker.healthy and self._workers.contains(worker)):
                continue
            self._workers.take_out(
                worker,
                f"did not take the fleet's {PAUSE_ROUTE} ({outcome.status}: {outcome.message}): out of routing "
                "while generation is paused; it rejoins once it takes the pause, or after the continue on the "
                "fleet's weight version",
            )

    async def _one(self, worker: Worker, route: str, body: bytes, headers: Mapping[str, str]) -> EngineOutcome:
        """`worker`'s answer to `route`; not waited for once it is removed from the fleet (`REMOVED`)."""
        post = post_control(self._client, worker, route, body, headers, self._timeout)
        try:
            return await self._workers.while_member(worker, post, "not waited for")
        except Unavailable as exc:
            return EngineOutcome(worker, None, str(exc))

    def _members(self, outcomes: list[EngineOutcome]) -> list[EngineOutcome]:
        """The outcomes of engines still in the fleet: one removed meanwhile is neither waited for nor counted."""
        return [outcome for outcome in outcomes if self._workers.contains(outcome.worker)]
