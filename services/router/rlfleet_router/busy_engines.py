"""Engines the router keeps busy itself: loading weights it sent them, or paused by a /pause_generation it relayed.

SGLang runs a generation only once no weight update holds its `model_update_lock` and generation is not paused
(`is_pause`), and its health probe (`/health_generate`; `/health` too before 2026, and since then with
`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`) is a one-token generation: while the router loads weights into an
engine or keeps it paused, that probe waits and times out however healthy the engine is. Judged by it, every engine
loading a large checkpoint would fail its way out of routing (and be restarted) before the load ends. The health
checker therefore asks `reason(worker)` first and checks a busy engine with `LIVENESS_ROUTE`, which SGLang's HTTP
process answers from memory behind neither gate: an engine that is gone (connection refused) or hung (no answer)
still fails it, and the weight request itself stays bounded by its own deadline.

A pause counts for at most `pause_bound_secs`: a trainer that died between /pause_generation and
/continue_generation must neither shield an engine from its probes nor stall its generation for ever. The
health loop collects the pauses that outlived it (`expire_pauses`), and the router continues generation on
those engines itself (`Fanout.end_pauses`).

The metric `rlfleet_router_engine_busy` shows the busy engines that are in the fleet at scrape time, as the per-engine
gauges of `rlfleet_router.metrics` do: a removed engine's series goes with it, not at the next health round (which
forgets what is known of it), and a load still under way there when it left brings none back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rlfleet_router.workers import Worker, WorkerRegistry

LIVENESS_ROUTE = "/model_info"
"""Answered by SGLang's HTTP process from memory (no model lock, no scheduler round trip), during loads and pauses.
SGLang before /model_info answers it as /get_model_info, which later ones log as deprecated at every call; an
engine that answers 404 here is asked there (`LEGACY_LIVENESS_ROUTE`)."""
LEGACY_LIVENESS_ROUTE = "/get_model_info"
LOADING = "loading"
PAUSED = "paused"


class BusyEngines(Collector):
    def __init__(self, pause_bound_secs: float, registry: CollectorRegistry, fleet: WorkerRegistry) -> None:
        self._pause_bound = pause_bound_secs
        self._fleet = fleet
        self._loads: dict[str, int] = {}  # worker id -> weight requests of the router it is serving now
        self._paused_until: dict[str, float] = {}  # worker id -> time.monotonic() its pause stops counting
        self._workers: dict[str, Worker] = {}  # the busy ones, for the metric and `expire_pauses`
        self._changes: dict[str, int] = {}  # worker id -> times it became busy or stopped being busy
        registry.register(self)

    @contextmanager
    def loading(self, workers: Iterable[Worker]) -> Iterator[None]:
        """`workers` are busy with a weight request of the router while the block runs (nests)."""
        held = list(workers)
        self.start_loading(held)
        try:
            yield
        finally:
            self.end_loading(held)

    def start_loading(self, workers: Iterable[Worker]) -> None:
        """`loading` for a request that outlives the block that sent it: each call needs one `end_loading`."""
        for worker in workers:
            self._loads[worker.id] = self._loads.get(worker.id, 0) + 1
            self._changed(worker)

    def end_loading(self, workers: Iterable[Worker]) -> None:
        for worker in workers:
            left = self._loads.pop(worker.id) - 1
            if left:
                self._loads[worker.id] = left
            self._changed(worker)

    @property
    def pause_bound_secs(self) -> float:
        return self._pause_bound

    def pause(self, workers: Iterable[Worker], until: float) -> None:
        """`workers` are paused until `time.monotonic()` reaches `until` at the latest (`FleetPause` sets it)."""
        for worker in workers:
            self._paused_until[worker.id] = until
            self._changed(worker)

    def resume(self, workers: Iterable[Worker]) -> None:
        for worker in workers:
            if self._paused_until.pop(worker.id, None) is not None:
                self._changed(worker)

    def reason(self, worker: Worker) -> str | None:
        """Why the router expects `worker`'s generation probe to wait now (LOADING, PAUSED), or None."""
        if worker.id in self._loads:
            return LOADING
        until = self._paused_until.get(worker.id)
        if until is not None and time.monotonic() < until:
            return PAUSED
        return None  # not paused, or for longer than the pause bound: its probes count again

    def expire_pauses(self) -> list[Worker]:
        """The engines whose pause outlived `pause_bound_secs`, paused no more for the router from now on."""
        now = time.monotonic()
        expired = [self._workers[worker_id] for worker_id, until in self._paused_until.items() if until <= now]
        self.resume(expired)
        return expired

    def changes(self, worker: Worker) -> int:
        """A count that moves whenever `worker` becomes busy or stops being busy: a probe that saw it move
        may have waited on a load or pause it did not know of."""
        return self._changes.get(worker.id, 0)

    def keep_only(self, workers: Iterable[Worker]) -> None:
        """Forgets what it knows of engines no longer in the fleet, but the weight requests still under way there:
        each `start_loading` has its `end_loading`, which forgets them (an engine removed mid-load)."""
        ids = {w.id for w in workers}
        for known in (self._paused_until, self._workers, self._changes):
            for worker_id in [k for k in known if k not in ids]:
                del known[worker_id]

    def collect(self) -> Iterator[Metric]:
        busy = GaugeMetricFamily(
            "rlfleet_router_engine_busy",
            "1 while the router keeps an engine busy (reason: loading weights it sent, paused by a "
            "/pause_generation it relayed); its health is then checked with /model_info.",
            labels=["engine", "reason"],
        )
        now = time.monotonic()
        for worker in list(self._workers.values()):
            if not self._fleet.contains(worker):
                continue
            if worker.id in self._loads:
                busy.add_metric([worker.url, LOADING], 1.0)
            elif self._paused_until.get(worker.id, 0.0) > now:
                busy.add_metric([worker.url, PAUSED], 1.0)
        yield busy

    def _changed(self, worker: Worker) -> None:
        self._changes[worker.id] = self._changes.get(worker.id, 0) + 1
        if worker.id in self._loads or worker.id in self._paused_until:
            self._workers[worker.id] = worker
        else:
            self._workers.pop(worker.id, None)
