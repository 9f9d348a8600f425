"""The generation requests the router holds, so that a client's /abort_request reaches those at no engine.

A request is in the router from its arrival until its answer, and for part of that time at no engine: held back by
the prefill stagger, waiting to be retried after an engine failed, connecting to its engine. A client's
/abort_request, fanned out to the engines, reaches only the requests they hold; one the router held at that moment
was sent afterwards and generated in full. So each request is registered here while the proxy forwards it, and the
abort marks the ones it names (`abort`: by rid, or all) before it goes to the engines. A marked request is never
written to an engine from then on: its waits end, and it finishes at once (`RequestAborted`), answered as SGLang
answers a request aborted before its prefill (`abort_answers`). One already written to its engine is left to that
engine, which the fan-out reaches.

A request names its rids in its body (`engine_aborts.request_rids`): one, or one per prompt of a batch. An abort
names one rid, and the router cannot split a batch, so a batch finishes once aborts have named each of its rids (or
an abort_all came); one only partly named goes on. The system's own aborts (a pause, a weight load's
abort_all_requests, the router's abort of an engine holding part of a version) do not come here.
"""

from __future__ import annotations

import asyncio

from rlfleet_router.engine_client import Interrupt


class RequestAborted(Exception):
    """A client's /abort_request named the request while the router held it: it was not sent (again)."""


class HeldRequest:
    """One generation request the proxy forwards; `aborted` is done once an abort named it."""

    __slots__ = ("rids", "aborted", "_interrupt", "_named")

    def __init__(self, rids: tuple[str, ...]) -> None:
        self.rids = rids
        self.aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._interrupt: Interrupt | None = None  # of its attempt under way at an engine
        self._named: set[str] = set()

    def attach(self, interrupt: Interrupt) -> None:
        """`interrupt` is that of the request's attempt from now on: an abort stops its sending."""
        self._interrupt = interrupt
        if self.aborted.done():
            interrupt.stop_sending(RequestAborted("the client aborted the request before it was sent"))

    def check(self) -> None:
        """RequestAborted if an abort named the request."""
        if self.aborted.done():
            raise RequestAborted("the client aborted the request while the router held it")

    def named(self, rid: str | None) -> bool:
        """Records that an abort named `rid` (None: all); True once the request is aborted."""
        if self.aborted.done():
            return False
        if rid is not None:
            self._named.add(rid)
            if not self._named.issuperset(self.rids):
                return False
        self.aborted.set_result(None)
        if self._interrupt is not None:
            self._interrupt.stop_sending(RequestAborted("the client aborted the request before it was sent"))
        return True


class HeldRequests:
    def __init__(self) -> None:
        self._held: set[HeldRequest] = set()
        self._by_rid: dict[str, list[HeldRequest]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, rids: tuple[str, ...]) -> HeldRequest:
        """Registers a request naming `rids` until `release`."""
        held = HeldRequest(rids)
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
