"""The generation requests the router holds, so that a client's /abort_request reaches those at no engine.

A request is in the router from its arrival until its answer, and for part of that time at no engine: held back by
the prefill stagger, waiting to be retried after an engine failed, connecting to its engine. A client's
/abort_request, fanned out to the engines, reaches only the requests they hold; one the router held at that moment
was sent afterwards and generated in full. So each request is registered here while the proxy forwards it, and the
abort marks the ones it names (`abort`: by rid, or all) before it goes to the engines. A marked request is never
written to an engine from then on: its waits end, and it finishes at once (`RequestAborted`), answered as SGLang
answers a request aborted before its prefill (`abort_answers`). One already written to its engine is that engine's
to abort, which the fan-out asks.

But an engine learns a request's rid only once it has read the request, and SGLang drops an abort of a rid it does
not know: the fan-out, sent just after the request was written, may reach the engine first and miss it. So for a
request written less than ABORT_RACE_SECS before an abort named it, the router asks its engine again, by the rids
named, ABORT_RACE_SECS after the write, if the request is still there (`abort_at_engine`).

A request names its rids in its body (`engine_aborts.request_rids`): one, or one per prompt of a batch. An abort
names one rid; the router cannot split a batch, so a batch is aborted whole once aborts have named each of its rids
(or an abort_all came). One named only in part goes on, as SGLang runs the other prompts of a batch whose rid it
aborts: once written, its engine is asked to abort the rids named (ABORT_RACE_SECS after the write, when the engine
knows them), and those prompts end there as SGLang ends any aborted one. The system's own aborts (a pause, a weight
load's abort_all_requests, the router's abort of an engine holding part of a version) do not come here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rlfleet_router.engine_client import Interrupt

# How long after a request is written its engine may still not know its rid: an abort sent before then may be
# dropped. SGLang registers a request's rids as its handler starts, once the body is read (milliseconds); the margin
# covers an engine whose event loop is busy.
ABORT_RACE_SECS = 0.5

AbortAtEngine = Callable[[tuple[str, ...], float], None]
"""`abort_at_engine(rids, at)`: asks the engine an attempt was written to to abort `rids` at `at` (time.monotonic())
if the attempt is still under way then."""


class RequestAborted(Exception):
    """A client's /abort_request named the request while the router held it: it was not sent (again)."""


class HeldRequest:
    """One generation request the proxy forwards; `aborted` is done once an abort named it (all of its rids)."""

    __slots__ = ("rids", "aborted", "_interrupt", "_abort_at_engine", "_named", "_race_secs")

    def __init__(self, rids: tuple[str, ...], race_secs: float = ABORT_RACE_SECS) -> None:
        self.rids = rids
        self.aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._interrupt: Interrupt | None = None  # of its attempt under way at an engine
        self._abort_at_engine: AbortAtEngine | None = None  # of that attempt
        self._named: set[str] = set()
        self._race_secs = race_secs

    def attach(self, interrupt: Interrupt, abort_at_engine: AbortAtEngine | None = None) -> None:
        """`interrupt` is that of the request's attempt from now on: an abort stops its sending. `abort_at_engine`
        asks that attempt's engine to abort rids (see the module docstring)."""
        self._interrupt = interrupt
        self._abort_at_engine = abort_at_engine
        if self.aborted.done():
            interrupt.stop_sending(RequestAborted("the client aborted the request before it was sent"))
        elif self._named:  # a batch named in part: its engine aborts those rids once it has the batch
            interrupt.on_sent = self._sent

    def check(self) -> None:
        """RequestAborted if an abort named the request."""
        if self.aborted.done():
            raise RequestAborted("the client aborted the request while the router held it")

    def named(self, rid: str | None) -> bool:
        """Records that an abort named `rid` (None: all); True once the request is aborted."""
        if self.aborted.done():
            return False
        self._named.update(self.rids if rid is None else (rid,))
        whole = rid is None or self._named.issuperset(self.rids)
        interrupt = self._interrupt
        if interrupt is not None and interrupt.sent_at is not None:
            # Written already: the fan-out may reach its engine before the request does.
            self._abort_again(interrupt.sent_at, self.rids if rid is None else (rid,))
        elif interrupt is not None and not whole:
            interrupt.on_sent = self._sent
        if not whole:
            return False
        self.aborted.set_result(None)
        if interrupt is not None:
            interrupt.stop_sending(RequestAborted("the client aborted the request before it was sent"))
        return True

    def _sent(self) -> None:
        """The request was written with rids named in part: its engine aborts them once it knows them."""
        interrupt = self._interrupt
        if interrupt is not None and interrupt.sent_at is not None and self._abort_at_engine is not None:
            named = tuple(rid for rid in self.rids if rid in self._named)
            self._abort_at_engine(named, interrupt.sent_at + self._race_secs)

    def _abort_again(self, sent_at: float, rids: tuple[str, ...]) -> None:
        """An abort of `rids` is fanned out now to the engines; the request's was written at `sent_at`."""
        at = sent_at + self._race_secs
        if rids and self._abort_at_engine is not None and time.monotonic() < at:
            self._abort_at_engine(rids, at)


class HeldRequests:
    def __init__(self, race_secs: float = ABORT_RACE_SECS) -> None:
        self._race_secs = race_secs
        self._held: set[HeldRequest] = set()
        self._by_rid: dict[str, list[HeldRequest]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, rids: tuple[str, ...]) -> HeldRequest:
        """Registers a request naming `rids` until `release`."""
        held = HeldRequest(rids, self._race_secs)
        self._held.add(held)
        for rid in rids:
            self._by_rid.setdefault(rid, []).append(held)
        return held

    def release(self, held: HeldRequest) -> None:
        """Forgets `held` (one never registered: nothing)."""
        if held not in self._held:
            return
        self._held.remove(held)
        for rid in held.rids:
            same = self._by_rid.get(rid)
            if same is not None:
                same.remove(held)
                if not same:
                    del self._by_rid[rid]

    def abort(self, rid: str | None) -> int:
        """Marks the requests named by `rid` exactly (SGLang aborts only a rid it knows), or every one (None:
        abort_all); returns how many were aborted by it."""
        targets = list(self._held) if rid is None else list(self._by_rid.get(rid, ()))
        return sum(held.named(rid) for held in targets)
