"""One control request to one engine (abort, pause, continue, flush the cache) and what became of it.

The fan-out to every engine (`fanout`) and the pause or continue that brings one engine in line with the
fleet's pause as it enters routing (`fleet_pause`) send them the same way, each bounded by its timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from rlfleet_router.weights import describe_error
from rlfleet_router.workers import Worker

ABORT_ROUTE = "/abort_request"
PAUSE_ROUTE = "/pause_generation"
CONTINUE_ROUTE = "/continue_generation"
FLUSH_ROUTE = "/flush_cache"
JSON_HEADERS = {"content-type": "application/json"}
ABORT_ALL = b'{"abort_all": true}'
"""The body of an /abort_request that ends every request at the engine (SGLang's and rlfleet-engine's alike)."""


@dataclass(frozen=True)
class EngineOutcome:
    worker: Worker
    status: int | None  # None: no answer (connection error or timeout), or not sent (the message says why)
    message: str

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def describe(self) -> dict[str, object]:
        return {"id": self.worker.id, "url": self.worker.url, "status": self.status, "message": self.message}


async def post_control(
    client: httpx.AsyncClient,
    worker: Worker,
    route: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_secs: float,
) -> EngineOutcome:
    """POSTs `body` to `route` of `worker` within `timeout_secs`; never raises for what the engine does."""
    try:
        response = await client.post(f"{worker.url}{route}", content=body, headers=headers, timeout=timeout_secs)
    except httpx.HTTPError as exc:
        return EngineOutcome(worker, None, describe_error(exc))
    return EngineOutcome(worker, response.status_code, response.text[:200])
