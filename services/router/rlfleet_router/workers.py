"""The worker registry: which engines belong to the fleet, and each one's routing state.

Transport-free: the health checker, the proxy and the weight fan-out report what they observed
(`record_success`, `record_failure`, `take_out`) and the registry applies the state transitions, so
the rules for entering and leaving routing live in one place.

A worker is routable only in state HEALTHY. A new worker starts PENDING and is admitted after its
first successful probe; a worker that was taken out (UNHEALTHY) needs `success_threshold`
consecutive successes. Either way the caller brings it to the fleet's weight version first
(`rlfleet_router.weights`), so no worker takes traffic on stale weights. Leaving routing forgets which
fleet load a worker applied, and tells `on_may_have_restarted` (the fleet's pause record forgets that it
took the pause): what comes back may be a restarted process on its initial weights, not paused.

A worker out of routing (however it left: failed probes, a failed weight load, a broken weight update
group, version drift; or pending and never up) that is not being restarted is handed to `on_failed` (the
self-healing fleet restarts it) once it failed `failure_threshold` probes in a row. Being refused by
admission (`hold_back`) is not a failure: the engine answers, and a restart would not change what keeps it
out.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import re
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

from rlfleet.errors import InvalidInput, NotFound, Unavailable

logger = logging.getLogger(__name__)


class NoHealthyEngine(Unavailable):
    """No engine is in routing; the HTTP layer tells the client when to try again (`Retry-After`)."""

    def __init__(self, total: int) -> None:
        super().__init__(f"no healthy engine: 0 of {total} engines are in routing; GET /workers shows why")


class WorkerState(enum.StrEnum):
    PENDING = "pending"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass
class Worker:
    """One engine. Mutated only through `WorkerRegistry` (state) and the proxy (`in_flight*`)."""

    url: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    state: WorkerState = WorkerState.PENDING
    in_flight: int = 0
    in_flight_tokens: int = 0  # estimated prompt + completion tokens of the requests in flight
    weight_version: str | None = None
    model_path: str | None = None  # where its weights came from, as it reports it (SGLang sets it on a disk load)
    # The fleet load (`FleetWeights.loads`) the router saw it apply whole; None until then, and once it left routing:
    # it may have restarted meanwhile, on other weights under the same version label.
    weight_load: int | None = None
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    probes_passed: int = 0  # in all: the healer counts a restart done once one more has passed
    last_error: str | None = None
    restarting: bool = False  # the healer is bringing it back (restarts, waits, backs off); out of routing meanwhile
    restarts: int = 0
    added_at: float = field(default_factory=time.monotonic)  # a new engine gets the restart timeout to come up

    @property
    def healthy(self) -> bool:
        return self.state is WorkerState.HEALTHY

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "healthy": self.healthy,
            "state": self.state.value,
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "weight_version": self.weight_version,
            "model_path": self.model_path,
            "last_error": self.last_error,
            "restarting": self.restarting,
            "restarts": self.restarts,
        }


T = TypeVar("T")
MEMBERSHIP_CHECK_SECS = 0.2
"""How often a wait on one engine (a control it was sent, a load to rejoin) looks whether it is still in the fleet."""
DEFAULT_PORTS = {"http": 80, "https": 443}
# A host name's labels (RFC 1123, with the underscore Docker's container and compose service names may hold).
_HOST_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


def normalize_worker_url(url: str) -> str:
    """`http://host:port` in one spelling per engine (scheme and host in lower case, no trailing slash, the
    scheme's default port left out), so one engine given twice is one worker; raises InvalidInput naming
    what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput("url: must be a non-empty string like http://127.0.0.1:30001")
    url = url.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        if parts.port == 0:  # reading .port also raises ValueError for a non-numeric or out-of-range port
            raise ValueError("port 0")
    except ValueError as exc:
        raise InvalidInput(f"url: {url!r} is not a valid URL ({exc})") from exc
    if parts.scheme.lower() not in DEFAULT_PORTS:
        raise InvalidInput(f"url: {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise InvalidInput(f"url: {url!r} has no host")
    if parts.query or parts.fragment or parts.path:
        raise InvalidInput(f"url: {url!r} must be the engine's base URL, without a path or query")
    if parts.username is not None or parts.password is not None:
        raise InvalidInput(f"url: {url!r} must not carry credentials")
    if not _is_host(parts.hostname):
        raise InvalidInput(f"url: {url!r}: {parts.hostname!r} is neither an IP address nor a host name")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    scheme = parts.scheme.lower()
    port = "" if parts.port in (None, DEFAULT_PORTS[scheme]) else f":{parts.port}"
    return f"{scheme}://{host}{port}"


def _is_host(host: str) -> bool:
    """An IP address (dotted digits must make an IPv4 one), or a DNS name of at most 253 characters."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if all(label.isdigit() for label in labels) or len(host) > 253:  # 10.0.0.256, 1.2.3.4.5
        return False
    return all(_HOST_LABEL.fullmatch(label) for label in labels)


class WorkerRegistry:
    """The fleet's members by id, in the order they were added."""

    def __init__(self, failure_threshold: int, success_threshold: int) -> None:
        if failure_threshold < 1 or success_threshold < 1:
            raise ValueError("failure_threshold and success_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._workers: dict[str, Worker] = {}
        # Told when a worker out of routing and not being restarted has failed `failure_threshold` probes in a
        # row (the self-healing fleet restarts it).
        self.on_failed: Callable[[Worker], None] | None = None
        # Told first, as a worker fails its way out of routing or keeps failing out of it, for the requests still at
        # it (the proxy moves them to other engines).
        self.on_failed_requests: Callable[[Worker], None] | None = None
        # Told when the engine behind a worker may be another process from now on: it left routing, or was
        # restarted (the fleet's pause record no longer trusts that it took the pause).
        self.on_may_have_restarted: Callable[[Worker], None] | None = None

    def add(self, url: str) -> tuple[Worker, bool]:
        """Returns the worker for `url` and whether it is new (adding a known URL is a no-op)."""
        url = normalize_worker_url(url)
        for worker in self._workers.values():
            if worker.url == url:
                return worker, False
        worker = Worker(url=url)
        self._workers[worker.id] = worker
        logger.info("worker %s added (%s)", url, worker.id)
        return worker, True

    def get(self, key: str) -> Worker:
        """By id, or by URL in any spelling `add` takes for it (sglang-router's older API names workers by URL)."""
        if key in self._workers:
            return self._workers[key]
        try:
            url = normalize_worker_url(key)
        except InvalidInput:  # neither an id nor a URL: no worker has it
            url = ""
        for worker in self._workers.values():
            if worker.url == url:
                return worker
        raise NotFound(f"worker {key!r} is not in the fleet; GET /workers lists the members")

    def remove(self, key: str) -> Worker:
        worker = self.get(key)
        del self._workers[worker.id]
        logger.info("worker %s removed (%s)", worker.url, worker.id)
        return worker

    def move(self, worker: Worker, url: str) -> Worker | None:
        """The engine behind `worker` now serves at `url` (a replacement pod); it keeps its id and state. If another
        worker has that URL already (discovery found the replacement first), nothing moves and that one is
        returned: one engine is never two workers."""
        url = normalize_worker_url(url)
        for other in self._workers.values():
            if other.url == url and other is not worker:
                return other
        worker.url = url
        return None

    def contains(self, worker: Worker) -> bool:
        return self._workers.get(worker.id) is worker

    async def while_member(self, worker: Worker, call: Coroutine[object, object, T], stopped: str) -> T:
        """Awaits `call`, abandoned once `worker` is removed from the fleet: Unavailable saying what `stopped`."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=MEMBERSHIP_CHECK_SECS)
                if done:
                    return task.result()
                if not self.contains(worker):
                    raise Unavailable(f"{worker.url} was removed from the fleet; {stopped}")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.healthy]

    def ready_to_admit(self, worker: Worker) -> bool:
        """Whether a probe success should now bring `worker` (not yet healthy) into routing: not while it is being
        restarted (the process answering may be the one the restarter is about to replace: admitted, it stayed in
        routing once replaced, the new process serving its boot weights)."""
        if worker.healthy or worker.restarting:
            return False
        if worker.state is WorkerState.PENDING:
            return True
        return worker.consecutive_successes >= self.success_threshold

    def record_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        worker.probes_passed += 1

    def hold_back(self, worker: Worker, reason: str) -> None:
        """`worker` passed its probes but may not enter routing yet (admission refused it, `reason`): it needs
        `success_threshold` successes again, but this is no failure of the engine (no restart comes of it)."""
        worker.consecutive_successes = 0
        worker.last_error = reason

    def admit(self, worker: Worker) -> None:
        if not worker.healthy:
            logger.info("worker %s is healthy; routing to it", worker.url)
        worker.state = WorkerState.HEALTHY
        worker.last_error = None

    def record_failure(self, worker: Worker, reason: str) -> None:
        """A failed probe or connection; after `failure_threshold` in a row the worker leaves routing."""
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        worker.last_error = reason
        if worker.consecutive_failures < self.failure_threshold:
            return
        if worker.healthy:
            worker.state = WorkerState.UNHEALTHY
            logger.warning(
                "worker %s failed %d times in a row (%s); taken out of routing",
                worker.url,
                worker.consecutive_failures,
                reason,
            )
            self._forget_process(worker)
        # Requests at an engine taken out of routing stay there to finish; once it keeps failing, they stop waiting
        # for it too (a hung engine answers none) as they do at one that fails its way out.
        if self.on_failed_requests is not None:
            self.on_failed_requests(worker)
        # However it left routing (here, `take_out`, or never joined), an engine that keeps failing is restarted.
        if not worker.restarting and self.on_failed is not None:
            self.on_failed(worker)

    def take_out(self, worker: Worker, reason: str) -> None:
        """Out of routing at once (e.g. it failed a weight update and serves a stale version)."""
        if worker.healthy:
            logger.warning("worker %s taken out of routing: %s", worker.url, reason)
        worker.state = WorkerState.UNHEALTHY
        worker.consecutive_successes = 0
        worker.last_error = reason
        self._forget_process(worker)

    def restarted(self, worker: Worker) -> None:
        """The engine behind `worker` (out of routing) was restarted: a new process, holding nothing the router
        recorded of the old one, and on probation until its probes pass again. What it serves is unknown until its
        admission reads it."""
        worker.state = WorkerState.UNHEALTHY
        worker.consecutive_successes = 0
        worker.weight_version = worker.model_path = None
        self._forget_process(worker)

    def _forget_process(self, worker: Worker) -> None:
        """What the router knew of the process behind `worker` (the fleet load it applied, that it took the pause)
        holds no more."""
        worker.weight_load = None
        if self.on_may_have_restarted is not None:
            self.on_may_have_restarted(worker)
