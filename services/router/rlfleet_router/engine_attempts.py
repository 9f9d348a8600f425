"""The requests in flight at each engine, one attempt each: their load on the engine, the rids they go by
there (which an abort by rid must spare: `engine_aborts`), and the way to stop waiting for them.

An engine that fails probes or connections in a row (`WorkerRegistry.record_failure`), leaving routing
so or already out of it (taken out with requests left to finish there), may still hold requests the
router sent it, and a hung engine answers none of them. Its attempts are interrupted then
(`engine_failed`) rather than left to wait out the request timeout: the proxy sends a request that had
not reached its client yet to another engine, and ends a stream under way with an error. So are those
at an engine whose answers would be wrong from now on (`interrupt`: it holds part of a weight version
and is about to resume them). A client that leaves interrupts its attempt the same way (`ClientGone`).
"""

from __future__ import annotations

from rlfleet_router.engine_client import Interrupt
from rlfleet_router.workers import Worker


class EngineFailed(Exception):
    """The engine left routing as failed, or can no longer answer rightly, while the request was at it."""


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


class Attempt:
    """One request at one engine, from its sending until its answer is read or given up; `rids`: those its body
    names (one, or one per prompt of a batch; none if it names none)."""

    __slots__ = ("worker", "tokens", "rids", "interrupt", "_attempts")

    def __init__(self, worker: Worker, tokens: int, rids: tuple[str, ...], attempts: EngineAttempts) -> None:
        self.worker = worker
        self.tokens = tokens
        self.rids = rids
        self.interrupt = Interrupt()
        self._attempts: EngineAttempts | None = attempts
        worker.in_flight += 1
        worker.in_flight_tokens += tokens

    @property
    def ended(self) -> bool:
        """Whether `end()` was called: the answer was read, or the request given up."""
        return self._attempts is None

    def end(self) -> None:
        """Takes the request off the engine's load; later calls do nothing."""
        if self._attempts is None:
            return
        self._attempts.forget(self)
        self._attempts = None
        self.worker.in_flight -= 1
        self.worker.in_flight_tokens -= self.tokens


class EngineAttempts:
    def __init__(self) -> None:
        # By worker id, its attempts under way; an engine with none has no entry, so engines that come and go
        # (pods by IP) leave nothing behind.
        self._waiting: dict[str, set[Attempt]] = {}

    def start(self, worker: Worker, tokens: int, rids: tuple[str, ...] = ()) -> Attempt:
        """Counts a request of about `tokens` tokens, named by `rids`, at `worker` until the attempt's `end()`."""
        attempt = Attempt(worker, tokens, rids, self)
        waiting = self._waiting.get(worker.id)
        if waiting is None:
            self._waiting[worker.id] = {attempt}
        else:
            waiting.add(attempt)
        return attempt

    def rids_at(self, worker: Worker, besides: Attempt | None = None) -> list[str]:
        """The rids of the requests under way at `worker`, but for those of `besides`."""
        return [rid for attempt in self._waiting.get(worker.id, ()) if attempt is not besides for rid in attempt.rids]

    def forget(self, attempt: Attempt) -> None:
        """`attempt` is over (its `end()` calls this)."""
        waiting = self._waiting.get(attempt.worker.id)
        if waiting is not None:
            waiting.discard(attempt)
            if not waiting:
                del self._waiting[attempt.worker.id]

    def engine_failed(self, worker: Worker) -> None:
        """Every attempt under way at `worker`, out of routing and failing, stops waiting for it."""
        self.interrupt(worker, f"{worker.url} failed and is out of routing ({worker.last_error})")

    def interrupt(self, worker: Worker, reason: str) -> None:
        """Every attempt under way at `worker` stops waiting for it, with `EngineFailed(reason)`."""
        waiting = self._waiting.get(worker.id)
        if not waiting:
            return
        for attempt in list(waiting):
            # One error each: an exception carries the traceback of where it is raised.
            attempt.interrupt.fire(EngineFailed(reason))
