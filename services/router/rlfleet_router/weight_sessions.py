"""SGLang's weight-update sessions, kept by the router for the fleet's weight loads.

From SGLang 0.5.23 an engine takes `/update_weights_from_distributed` (and `/update_weights_from_tensor`) only
between its `/begin_weight_update` and `/end_weight_update`, and refuses it otherwise (400); the end finishes
the weights the updates loaded (packs in-place quantized ones again) and, on SGLang's main branch, is when the
version an update carried inside the session is published. Earlier SGLang has neither route (404) and needs no
session. The trainer sends buckets to the fleet, not to engines, so the router opens each member's session before
the first bucket of a version reaches it and ends it once the bucket carrying the version is applied there, or when
the group closes. A session left open (a group that broke, an end that failed, a router restarted mid-version) is
ended before the next begins, since SGLang refuses a second begin, and before a load from disk into that engine
(`before_disk_load`): a version held back until an end nobody sends would leave the engine reporting its old
one, reloaded for drift again and again, and a later end would finish again weights the disk load finished.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlfleet_router.weights import EngineUpdateResult
    from rlfleet_router.workers import Worker

logger = logging.getLogger(__name__)

BEGIN_ROUTE = "/begin_weight_update"
END_ROUTE = "/end_weight_update"
_NO_BODY = b"{}"
_ALREADY_OPEN = "already open"  # SGLang's refusal of a begin while a session is open


class PostUpdate(Protocol):
    """`FleetWeights.post_update`: one weight request to one engine, bounded by `timeout` (None: the router's)."""

    async def __call__(
        self, worker: Worker, route: str, request_body: bytes, timeout: float | None = None
    ) -> EngineUpdateResult: ...


class WeightSessions:
    def __init__(self, post: PostUpdate) -> None:
        self._post = post
        self._open: set[str] = set()  # engines (worker ids) with a session this router opened
        # Engines known to hold no session: this router ended theirs, or found none open. Any other engine may hold
        # one (this router restarted, an end failed or got no answer) until asked.
        self._closed: set[str] = set()
        self._sessionless: set[str] = set()  # engines without the routes (SGLang before sessions)

    def forget(self, workers: Iterable[Worker]) -> None:
        """What the router knows of `workers`' sessions may be stale (a group opens with them: an engine restarted,
        and maybe upgraded, since their last): their next begin asks them again."""
        for worker in workers:
            self._open.discard(worker.id)
            self._closed.discard(worker.id)
            self._sessionless.discard(worker.id)

    async def begin(self, worker: Worker) -> EngineUpdateResult | None:
        """Opens `worker`'s session unless it has one open or needs none; the failure if it could not."""
        if worker.id in self._open or worker.id in self._sessionless:
            return None
        self._closed.discard(worker.id)
        result = await self._post(worker, BEGIN_ROUTE, _NO_BODY)
        if result.status == HTTPStatus.NOT_FOUND:
            logger.info("worker %s has no weight-update sessions (no %s): updates reach it as they are", worker.url,
                        BEGIN_ROUTE)  # fmt: skip
            self._sessionless.add(worker.id)
            return None
        if not result.success and _ALREADY_OPEN in result.message:
            logger.info("worker %s holds a weight-update session no update finished: ending it first", worker.url)
            await self._post(worker, END_ROUTE, _NO_BODY)
            result = await self._post(worker, BEGIN_ROUTE, _NO_BODY)
        if result.success:
            self._open.add(worker.id)
            return None
        return replace(result, message=f"{BEGIN_ROUTE}: {result.message}")

    async def end(self, worker: Worker) -> EngineUpdateResult | None:
        """Ends `worker`'s session if this router opened one; the failure if the engine refused."""
        if worker.id not in self._open:
            return None
        self._open.discard(worker.id)
        result = await self._post(worker, END_ROUTE, _NO_BODY)
        if result.success:
            self._closed.add(worker.id)
            return None
        return replace(result, message=f"{END_ROUTE}: {result.message}")

    async def before_disk_load(self, worker: Worker, timeout: float) -> None:
        """Ends a session `worker` may hold (within `timeout`) before weights are loaded into it from disk. An
        engine known to hold none is not asked; one that refuses the end (4xx: SGLang refuses an end without a
        begin) holds none. One that does not answer is loaded all the same: the load says what is wrong."""
        if worker.id in self._closed or worker.id in self._sessionless:
            return
        self._open.discard(worker.id)  # the disk load replaces whatever buckets the session took
        result = await self._post(worker, END_ROUTE, _NO_BODY, timeout=timeout)
        if result.status == HTTPStatus.NOT_FOUND:
            self._sessionless.add(worker.id)
        elif result.success:
            logger.info("worker %s held a weight-update session no update finished: ended before loading from disk",
                        worker.url)  # fmt: skip
            self._closed.add(worker.id)
        elif result.status is not None and 400 <= result.status < 500:
            self._closed.add(worker.id)
        else:
            logger.warning("worker %s: %s before loading from disk: %s; loading it all the same", worker.url,
                           END_ROUTE, result.message)  # fmt: skip
