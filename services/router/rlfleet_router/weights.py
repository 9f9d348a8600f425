"""Which weights the fleet serves: the fan-out of a weight update and the rejoin rule.

The router records the fleet's target (weight version, model path, and the update request as sent)
once at least one engine has loaded it. Every engine that was not part of that update (pending,
taken out, restarted) is brought to the target by `FleetWeights.admit` before it enters routing,
so rollouts never mix weight versions silently. One lock orders fleet updates and admissions: an
engine either joins on the version current when it joined, or is part of the next fan-out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx

from rlfleet.errors import Unavailable
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class WeightTarget:
    version: str
    model_path: str
    request_body: bytes  # sent unchanged to engines that rejoin, so they load exactly what the fleet did


@dataclass(frozen=True)
class EngineUpdateResult:
    worker_id: str
    url: str
    success: bool
    message: str
    seconds: float

    def describe(self) -> dict[str, object]:
        return {
            "id": self.worker_id,
            "url": self.url,
            "success": self.success,
            "message": self.message,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class FleetUpdateResult:
    success: bool
    message: str
    weight_version: str | None  # the fleet's version after the update (unchanged if every engine failed)
    engines: tuple[EngineUpdateResult, ...]
    skipped: tuple[Worker, ...]  # not healthy: they load the target before they rejoin

    def describe(self) -> dict[str, object]:
        return {
            "success": self.success,
            "message": self.message,
            "weight_version": self.weight_version,
            "engines": [r.describe() for r in self.engines],
            "skipped": [{"id": w.id, "url": w.url, "state": w.state.value} for w in self.skipped],
        }


class FleetWeights:
    def __init__(
        self, client: httpx.AsyncClient, workers: WorkerRegistry, timeout_secs: float, metrics: RouterMetrics
    ) -> None:
        self._client = client
        self._workers = workers
        self._timeout = timeout_secs
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self.target: WeightTarget | None = None
        self.updates = 0  # fleet updates that changed the target: the age unit of cached trajectories

    @property
    def version(self) -> str | None:
        return self.target.version if self.target else None

    async def update_fleet(self, model_path: str, version: str, request_body: bytes) -> FleetUpdateResult:
        """Sends `request_body` to every healthy engine at once; records the target if any engine loaded it.

        Engines that fail leave routing (they may serve either version now) and rejoin through
        `admit`. If every engine fails, nothing changes: they all still serve the old
        version, which is consistent.
        """
        async with self._lock:
            engines = self._workers.healthy()
            skipped = tuple(w for w in self._workers.all() if not w.healthy)
            if not engines:
                self._metrics.weight_updates.labels(result="failure").inc()
                raise Unavailable(
                    f"no healthy engine to load weight version {version!r} into; "
                    "GET /workers shows why each engine is out of routing"
                )
            results = await asyncio.gather(*(self._update_engine(w, request_body) for w in engines))
            failed = [r for r in results if not r.success]
            if len(failed) == len(results):
                self._metrics.weight_updates.labels(result="failure").inc()
                return FleetUpdateResult(
                    success=False,
                    message=f"no engine loaded weight version {version!r}; the fleet still serves {self.version!r}",
                    weight_version=self.version,
                    engines=tuple(results),
                    skipped=skipped,
                )
            self.target = WeightTarget(version=version, model_path=model_path, request_body=request_body)
            self.updates += 1
            for worker, result in zip(engines, results, strict=True):
                if result.success:
                    worker.weight_version = version
                else:
                    self._workers.take_out(worker, f"failed to load weight version {version!r}: {result.message}")
            self._metrics.weight_updates.labels(result="partial" if failed else "success").inc()
            loaded = len(results) - len(failed)
            message = f"{loaded}/{len(results)} healthy engines serve weight version {version!r}"
            if failed:
                message += "; the others were taken out of routing until they load it"
            logger.info("weight update: %s", message)
            return FleetUpdateResult(
                success=not failed, message=message, weight_version=version, engines=tuple(results), skipped=skipped
            )

    async def admit(self, worker: Worker) -> None:
        """Brings `worker` to the fleet's version (loading it if needed), then into routing.

        Both happen under the lock, so a fleet update cannot slip in between and leave the worker
        routable on the previous version. Raises Unavailable if the engine cannot load it.
        """
        async with self._lock:
            worker.weight_version = await self._engine_version(worker)
            target = self.target
            if target is not None and worker.weight_version != target.version:
                logger.info(
                    "worker %s serves weight version %r, the fleet %r: loading it before it rejoins",
                    worker.url,
                    worker.weight_version,
                    target.version,
                )
                result = await self._update_engine(worker, target.request_body)
                if not result.success:
                    raise Unavailable(f"could not load weight version {target.version!r}: {result.message}")
                worker.weight_version = target.version
            if self._workers.contains(worker):
                self._workers.admit(worker)

    async def _engine_version(self, worker: Worker) -> str | None:
        try:
            response = await self._client.get(f"{worker.url}/get_model_info", timeout=self._timeout)
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise Unavailable(f"could not read the weight version of {worker.url}: {describe_error(exc)}") from exc
        version = info.get("weight_version") if isinstance(info, dict) else None
        return None if version is None else str(version)

    async def _update_engine(self, worker: Worker, request_body: bytes) -> EngineUpdateResult:
        start = time.monotonic()
        success = False
        try:
            response = await self._client.post(
                f"{worker.url}/update_weights_from_disk",
                content=request_body,
                headers=JSON_HEADERS,
                timeout=self._timeout,
            )
        except httpx.HTTPError as exc:
            message = describe_error(exc)
        else:
            # SGLang answers {success, message}; success needs both HTTP 200 and `success: true`.
            body = parse_json_object(response)
            if body is None:
                message = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                success = response.status_code == 200 and body.get("success") is True
                message = str(body.get("message") or f"HTTP {response.status_code}")
        if not success:
            logger.warning("worker %s failed to load weights: %s", worker.url, message)
        return EngineUpdateResult(worker.id, worker.url, success, message, time.monotonic() - start)


def parse_json_object(response: httpx.Response) -> dict[str, object] | None:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def describe_error(exc: BaseException) -> str:
    """A connection error as one line (httpx errors often have an empty str())."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
