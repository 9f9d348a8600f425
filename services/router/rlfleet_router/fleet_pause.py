"""The fleet's generation pause as the router relayed it, and each engine's part in it.

A /pause_generation fanned out to every engine pauses the fleet until a /continue_generation is fanned out,
or for `BusyEngines.pause_bound_secs` at most (past it the router continues the engines itself:
`Fanout.end_pauses`). The router also records which engines it sent a pause to and which took a continue
since, so that an engine entering routing can be brought in line with the fleet (`match`): an engine paused
by the router that missed the continue (it was hung, or out of routing and refused it) would otherwise
rejoin paused and hold every request routed to it; one that joins while the fleet is paused (new, or it
missed the pause) would generate while the trainer updates weights. An engine in routing that missed the
pause leaves routing once the pause's answers are in (`Fanout`) and rejoins through `match` like these. Only
where the two may differ is anything sent: a router that knows of no pause (it restarted while the trainer
had generation paused) never continues an engine the trainer paused.

An engine removed from the fleet (DELETE /workers, or Kubernetes discovery dropping a NotReady pod) and added
again is a new worker, with another id, but may be the same engine, still paused by the router: so what the
router knows of a removed engine's pause is kept by URL (`removed`) and handed to the next worker at that URL,
until a continue reaches that URL or the pause bound passes (the engine has then been paused for longer than
a weight load may take: rlfleet-engine's --max-pause fails its probes, SGLang's wait behind the pause). Handed
over, it counts as a pause sent but maybe not taken: the engine at that URL may be a restarted process, not
paused, so if the fleet is paused it is sent the pause like any engine that joins. So does the pause of an engine
that left routing or was restarted (`may_have_restarted`): the healer keeps the worker, but not the process.

`match` sends its request before the engine enters routing, outside the fleet's weight lock; a pause or
continue fanned out meanwhile moves `turn`, and the engine enters routing only if `joins` finds the turn it
was matched at still current (else it is matched again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx

from rlfleet.errors import Unavailable
from rlfleet_router.busy_engines import BusyEngines
from rlfleet_router.engine_controls import (
    CONTINUE_ROUTE,
    JSON_HEADERS,
    PAUSE_ROUTE,
    EngineOutcome,
    post_control,
)
from rlfleet_router.workers import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pause:
    """A pause fanned out to the fleet: its request as relayed (sent again to engines that join meanwhile)."""

    body: bytes
    headers: Mapping[str, str]
    until: float  # time.monotonic() past which it no longer counts


class FleetPause:
    def __init__(self, client: httpx.AsyncClient, busy: BusyEngines, timeout_secs: float) -> None:
        """`timeout_secs` bounds one engine's answer to a pause or continue sent by `match`."""
        self.busy = busy
        self._client = client
        self._timeout = timeout_secs
        self._pause: Pause | None = None
        self._turn = 0
        # Worker id -> True once it took a pause of the router, False while one was sent but not taken (it may
        # still land); absent once it took a continue, or the router never paused it.
        self._engines: dict[str, bool] = {}
        # URL of an engine removed from the fleet with an entry in `_engines` -> time.monotonic() past which it is
        # forgotten.
        self._removed: dict[str, float] = {}

    @property
    def turn(self) -> int:
        """Moves whenever the fleet's pause begins or ends."""
        self._expire()
        return self._turn

    def paused(self) -> bool:
        self._expire()
        return self._pause is not None

    def current(self, pause: Pause) -> bool:
        """Whether the fleet's pause is `pause` still: no continue, newer pause or end of its bound since."""
        self._expire()
        return self._pause is pause

    def begin(self, workers: list[Worker], body: bytes, headers: Mapping[str, str]) -> Pause:
        """A /pause_generation with `body` and `headers` is about to be sent to `workers`, the whole fleet."""
        self._turn += 1
        pause = self._pause = Pause(body, dict(headers), time.monotonic() + self.busy.pause_bound_secs)
        self.busy.pause(workers, pause.until)  # before it lands: a probe sent meanwhile would wait behind it
        for worker in workers:
            self._engines[worker.id] = False
        return pause

    def end(self, pause: Pause | None = None) -> None:
        """The fleet's pause ends: a /continue_generation is about to be sent to the whole fleet, or no engine took
        the /pause_generation that began `pause` (ended only if it is still the fleet's)."""
        if pause is not None and self._pause is not pause:
            return
        self._turn += 1
        self._pause = None

    def record(self, route: str, outcomes: Iterable[EngineOutcome]) -> None:
        """What engines answered a pause or continue of the router. Whatever a continue's answer, the pause ends
        for the router's health checks: an engine still paused fails its probes."""
        outcomes = list(outcomes)
        if route == PAUSE_ROUTE:
            for outcome in outcomes:
                if outcome.ok:
                    self._engines[outcome.worker.id] = True
            self.busy.resume(o.worker for o in outcomes if not o.ok)
            return
        assert route == CONTINUE_ROUTE, route
        for outcome in outcomes:
            if outcome.ok:
                self._engines.pop(outcome.worker.id, None)
                self._removed.pop(outcome.worker.url, None)
        self.busy.resume(o.worker for o in outcomes)

    async def match(self, worker: Worker) -> int:
        """Brings `worker`, about to enter routing, in line with the fleet's pause: sends it the fleet's
        /pause_generation if the fleet is paused and it did not take that pause, /continue_generation if the
        fleet is not paused and the router paused it without a continue taken since. Returns the turn it was
        brought in line with (for `joins`); Unavailable if it did not take the request."""
        turn = self.turn
        pause = self._pause
        self._hand_over(worker)
        took_pause = self._engines.get(worker.id)
        if pause is not None and took_pause is not True:
            route, body, headers = PAUSE_ROUTE, pause.body, pause.headers
        elif pause is None and took_pause is not None:
            route, body, headers = CONTINUE_ROUTE, b"{}", JSON_HEADERS
        else:
            return turn
        outcome = await post_control(self._client, worker, route, body, headers, self._timeout)
        self.record(route, [outcome])
        if not outcome.ok:
            state = "paused" if pause is not None else "not paused"
            raise Unavailable(
                f"the fleet's generation is {state}, and this engine did not take {route} to match it "
                f"({outcome.status}: {outcome.message}); it rejoins once it does"
            )
        logger.info(
            "worker %s rejoins routing: sent it %s, as the fleet is %s",
            worker.url,
            route,
            "paused" if pause else "not paused",
        )
        return turn

    def joins(self, worker: Worker, turn: int) -> bool:
        """Whether `worker`, brought in line by `match` at `turn`, may enter routing now: no pause or continue
        began since. If so, and the fleet is paused, its pause ends with the fleet's (call as it enters routing)."""
        if self.turn != turn:
            return False
        if self._pause is not None:
            self.busy.pause([worker], self._pause.until)
        return True

    def removed(self, worker: Worker) -> None:
        """`worker` was removed from the fleet: if the router paused it without a continue taken since, the next
        worker added at its URL is sent a continue as it enters routing (see the module docstring)."""
        if self._engines.pop(worker.id, None) is not None:
            self._removed[worker.url] = time.monotonic() + self.busy.pause_bound_secs

    def may_have_restarted(self, worker: Worker) -> None:
        """The engine behind `worker` may be another process from now on (it left routing, or was restarted): a
        pause it took counts as sent but maybe not taken, so it is sent the fleet's pause again before it enters
        routing during one, and a continue after one."""
        if self._engines.get(worker.id) is True:
            self._engines[worker.id] = False

    def keep_only(self, workers: Iterable[Worker]) -> None:
        """Forgets what it knows of engines no longer in the fleet, and of removed ones past the pause bound."""
        workers = list(workers)
        self.busy.keep_only(workers)
        ids = {w.id for w in workers}
        for worker_id in [k for k in self._engines if k not in ids]:
            del self._engines[worker_id]
        now = time.monotonic()
        for url in [u for u, forget_at in self._removed.items() if forget_at <= now]:
            del self._removed[url]

    def _hand_over(self, worker: Worker) -> None:
        """Gives `worker` the record of the engine removed at its URL, if any and still within the pause bound."""
        forget_at = self._removed.pop(worker.url, None)
        if forget_at is not None and time.monotonic() < forget_at and worker.id not in self._engines:
            self._engines[worker.id] = False

    def _expire(self) -> None:
        if self._pause is not None and time.monotonic() >= self._pause.until:
            self._pause = None
            self._turn += 1
