"""SGLang's weight-update sessions, kept by the router for the fleet's distributed updates.

From SGLang 0.5.23 an engine takes `/update_weights_from_distributed` (and `/update_weights_from_tensor`) only
between its `/begin_weight_update` and `/end_weight_update`, and refuses it otherwise (400); the end finishes
the weights the updates loaded (packs in-place quantized ones again). Earlier SGLang has neither route (404) and
needs no session. The trainer sends buckets to the fleet, not to engines, so the router opens each member's
session before the first bucket of a version reaches it and ends it once the bucket carrying the version is
applied there, or when the group closes. A session left open (a group that broke) is ended before the next
begins: SGLang refuses a second begin.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from http import HTTPStatus

from rlfleet_router.weights import EngineUpdateResult, FleetWeights
from rlfleet_router.workers import Worker

logger = logging.getLogger(__name__)

BEGIN_ROUTE = "/begin_weight_update"
END_ROUTE = "/end_weight_update"
_NO_BODY = b"{}"
_ALREADY_OPEN = "already open"  # SGLang's refusal of a begin while a session is open


class WeightSessions:
    def __init__(self, weights: FleetWeights) -> None:
        self._weights = weights
        self._open: set[str] = set()  # engines (worker ids) with a session this router opened
        self._sessionless: set[str] = set()  # engines without the routes (SGLang before sessions)

    def forget(self, workers: Iterable[Worker]) -> None:
        """What the router knows of `workers`' sessions may be stale (a group opens with them: an engine restarted,
        and maybe upgraded, since their last): their next begin asks them again."""
        for worker in workers:
            self._open.discard(worker.id)
            self._sessionless.discard(worker.id)

    async def begin(self, worker: Worker) -> EngineUpdateResult | None:
        """Opens `worker`'s session unless it has one open or needs none; the failure if it could not."""
        if worker.id in self._open or worker.id in self._sessionless:
            return None
        result = await self._weights.post_update(worker, BEGIN_ROUTE, _NO_BODY)
        if result.status == HTTPStatus.NOT_FOUND:
            logger.info("worker %s has no weight-update sessions (no %s): updates reach it as they are", worker.url,
                        BEGIN_ROUTE)  # fmt: skip
            self._sessionless.add(worker.id)
            return None
        if not result.success and _ALREADY_OPEN in result.message:
            logger.info("worker %s holds a weight-update session no update finished: ending it first", worker.url)
            await self._weights.post_update(worker, END_ROUTE, _NO_BODY)
            result = await self._weights.post_update(worker, BEGIN_ROUTE, _NO_BODY)
        if result.success:
            self._open.add(worker.id)
            return None
        return replace(result, message=f"{BEGIN_ROUTE}: {result.message}")

    async def end(self, worker: Worker) -> EngineUpdateResult | None:
        """Ends `worker`'s session if this router opened one; the failure if the engine refused."""
        if worker.id not in self._open:
            return None
        self._open.discard(worker.id)
        result = await self._weights.post_update(worker, END_ROUTE, _NO_BODY)
        return None if result.success else replace(result, message=f"{END_ROUTE}: {result.message}")
