"""The router's Prometheus metrics, on a registry of its own (one per app, never the global one).

Counters and the latency histogram are updated as things happen; the per-engine gauges and the
weight version are read from the worker registry at scrape time, so a removed engine's series
disappears instead of freezing at its last value.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlfleet_router.chars_per_token import CharsPerToken
from rlfleet_router.engine_counter import EngineCounter
from rlfleet_router.policies import ROUTING_REASONS
from rlfleet_router.radix_tree import RadixTree
from rlfleet_router.trajectory_store import TrajectoryStore
from rlfleet_router.workers import WorkerRegistry, WorkerState

ENGINE_STATES = (*(s.value for s in WorkerState), "restarting")
ENGINE_ERROR_KINDS = ("connection", "http_5xx", "engine_failed")
RESTART_RESULTS = ("success", "failure")
WEIGHT_UPDATE_RESULTS = ("success", "partial", "failure")

MetricT = TypeVar("MetricT", Counter, Histogram)

# Generation requests run from milliseconds (cached, short) to minutes (long rollouts).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The router's own share of a request's latency is meant to stay well under a millisecond.
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


def version_as_number(version: str | None) -> float:
    """The gauge value of a weight version: the number when it is one (trainer steps are), NaN otherwise."""
    if version is None:
        return math.nan
    try:
        return float(version)
    except ValueError:
        return math.nan


class FleetCollector(Collector):
    def __init__(self, workers: WorkerRegistry, weight_version: Callable[[], str | None]) -> None:
        self._workers = workers
        self._weight_version = weight_version
        self.tree: RadixTree | None = None  # the cache_aware policy's prefix tree, when that policy routes
        self.trajectories: TrajectoryStore | None = None
        self.chars_per_token: CharsPerToken | None = None

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "rlfleet_router_engine_in_flight", "Requests the router has in flight at each engine.", labels=["engine"]
        )
        in_flight_tokens = GaugeMetricFamily(
            "rlfleet_router_engine_in_flight_tokens",
            "Estimated tokens (prompt + completion budget) of the requests in flight at each engine.",
            labels=["engine"],
        )
        healthy = GaugeMetricFamily(
            "rlfleet_router_engine_healthy", "1 if the engine is in routing, 0 otherwise.", labels=["engine"]
        )
        state = GaugeMetricFamily(
            "rlfleet_router_engine_state",
            "1 for the state each engine is in (pending, healthy, unhealthy, restarting: being restarted, backoff "
            "between attempts included), 0 for the others.",
            labels=["engine", "state"],
        )
        engine_version = GaugeMetricFamily(
            "rlfleet_router_engine_weight_version",
            "Weight version each engine serves (NaN until known or if not numeric).",
            labels=["engine"],
        )
        for worker in self._workers.all():
            engine_version.add_metric([worker.url], version_as_number(worker.weight_version))
            in_flight.add_metric([worker.url], worker.in_flight)
            in_flight_tokens.add_metric([worker.url], worker.in_flight_tokens)
            healthy.add_metric([worker.url], 1.0 if worker.healthy else 0.0)
            current = "restarting" if worker.restarting else worker.state.value
            for name in ENGINE_STATES:
                state.add_metric([worker.url, name], 1.0 if name == current else 0.0)
        yield in_flight
        yield in_flight_tokens
        yield healthy
        yield state
        yield engine_version
        if self.trajectories is not None:
            yield GaugeMetricFamily(
                "rlfleet_router_trajectories", "Trajectories in the token cache.", value=len(self.trajectories)
            )
            yield GaugeMetricFamily(
                "rlfleet_router_trajectory_tokens",
                "Tokens charged to the trajectory cache's budget: the ids it holds, 64 a trajectory and 32 a turn.",
                value=self.trajectories.tokens,
            )
            yield CounterMetricFamily(
                "rlfleet_router_trajectory_evictions",
                "Trajectories evicted as stale or over the token budget.",
                value=self.trajectories.evictions,
            )
        # Exported under every policy (0 without a tree), so a dashboard shows the same series whatever routes.
        tree = self.tree
        yield GaugeMetricFamily(
            "rlfleet_router_tree_tokens",
            "What the cache-aware prefix tree holds against --max-tree-tokens: its tokens plus 200 a node, a node's "
            "own memory (0 under a policy without one).",
            value=tree.used if tree is not None else 0,
        )
        yield GaugeMetricFamily(
            "rlfleet_router_tree_nodes", "Nodes of the prefix tree.", value=tree.nodes if tree is not None else 0
        )
        yield CounterMetricFamily(
            "rlfleet_router_tree_evictions",
            "Prefixes evicted from the tree to keep it within its token budget.",
            value=tree.evictions if tree is not None else 0,
        )
        if self.chars_per_token is not None:
            yield GaugeMetricFamily(
                "rlfleet_router_chars_per_token",
                "Characters per token of the engines' tokenizer, learned from their answers; sizes text prompts.",
                value=self.chars_per_token.value,
            )
        yield GaugeMetricFamily(
            "rlfleet_router_weight_version",
            "Weight version the fleet was last asked to serve (NaN before the first update or if not numeric).",
            value=version_as_number(self._weight_version()),
        )


class Children(Generic[MetricT]):
    """A labelled metric's children by label values, looked up once each: prometheus' `labels()` validates
    and locks on every call, a cost paid on every request of the generation path otherwise. For label sets that
    never go away; a metric labelled by engine is an EngineCounter, whose series leave with their engine."""

    def __init__(self, metric: MetricT) -> None:
        self._metric: MetricT = metric
        self._children: dict[tuple[str, ...], MetricT] = {}

    def __call__(self, *values: str) -> MetricT:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


# How long the series of an engine's former URL (it restarted at a new one) stay: long enough for Prometheus to
# scrape the restart counted under that URL, bounded so engines that come back by new pod IPs do not add series
# for as long as the router runs.
MOVED_ENGINE_SERIES_SECS = 600.0


GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# What a generation route answers besides an engine's own refusals: served, refused as malformed, the router's own
# fault, no engine answered (none to try, or it failed on every one tried), out of the request's deadline.
GENERATION_STATUSES = ("200", "400", "500", "503", "504")


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, weight_version: Callable[[], str | None]) -> None:
        self.registry = CollectorRegistry()
        self._moved_away: dict[str, float] = {}
        """Former engine URLs by when their series are dropped."""
        self.requests = Counter(
            "rlfleet_router_requests",
            "Requests answered by the router, by route template and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "rlfleet_router_request_seconds",
            "Time from a request's arrival to its last response byte, by route template.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "rlfleet_router_retries", "Requests sent again to another engine after a failure.", registry=self.registry
        )
        self.weight_updates = Counter(
            "rlfleet_router_weight_updates",
            "Fleet-wide weight updates, by result (success, partial, failure).",
            ["result"],
            registry=self.registry,
        )
        self.weight_update_engines_skipped = Counter(
            "rlfleet_router_weight_update_engines_skipped",
            "Engines a fleet weight update stopped waiting for: their health checks took them out of routing "
            "while they loaded (they load the version before they rejoin).",
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            "rlfleet_router_routing_decisions",
            "Engine choices by reason (cache_hit, imbalance, low_match, least_load, round_robin, ...).",
            ["reason"],
            registry=self.registry,
        )
        # Per engine: EngineCounter, so a count that comes after an engine left brings none of its series back.
        self.engine_errors = EngineCounter(
            "rlfleet_router_engine_errors",
            "Failed attempts at an engine, by kind (connection, http_5xx, engine_failed: taken out of routing as "
            "failed with the request there).",
            self.registry,
            by="kind",
            values=ENGINE_ERROR_KINDS,
        )
        self.prompt_tokens = EngineCounter(
            "rlfleet_router_prompt_tokens", "Prompt tokens the engines reported in their answers.", self.registry
        )
        self.cached_tokens = EngineCounter(
            "rlfleet_router_cached_tokens",
            "Prompt tokens the engines reported as served from their prefix cache; over prompt tokens, the hit rate.",
            self.registry,
        )
        self.added_latency = Histogram(
            "rlfleet_router_added_latency_seconds",
            "Time from a request's body being read to its being sent to an engine (parsing and routing; a prefill "
            "stagger's wait, counted in rlfleet_router_prefill_staggers_total, not included).",
            buckets=ADDED_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill_staggers = Counter(
            "rlfleet_router_prefill_staggers",
            "Requests held back (at most --prefill-stagger-ms) before being sent, as repeats of a prompt their engine "
            "was sent moments before: they arrive once its prefill has begun, and find the prompt cached.",
            registry=self.registry,
        )
        self.aborted_unsent = Counter(
            "rlfleet_router_aborted_unsent",
            "Generation requests a client's /abort_request named while the router held them at no engine (held back, "
            "waiting to be retried, connecting): answered as aborted, never sent.",
            registry=self.registry,
        )
        self.client_aborts_resent = Counter(
            "rlfleet_router_client_aborts_resent",
            "Rids a client's /abort_request named that the router asked their engine to abort itself, once the engine "
            "knew them: of a request written there just before the abort (which may have reached the engine first), "
            "or of a batch the abort named in part while the router held it.",
            registry=self.registry,
        )
        self.restarts = EngineCounter(
            "rlfleet_router_engine_restarts",
            "Restarts of failed engines, by engine (its URL before the restart) and result (success: it passed a "
            "probe within the restart timeout; failure: the restart failed, or it did not).",
            self.registry,
            by="result",
            values=RESTART_RESULTS,
        )
        self.health_check_failures = EngineCounter(
            "rlfleet_router_health_check_failures", "Failed health probes, by engine.", self.registry
        )
        self.engine_version_drifts = EngineCounter(
            "rlfleet_router_engine_version_drifts",
            "Engines in routing found serving another weight version than the router recorded (restarted by "
            "themselves, or loaded behind its back), by engine; each left routing to load the fleet's version.",
            self.registry,
        )
        self._engine_counters = (
            self.engine_errors,
            self.prompt_tokens,
            self.cached_tokens,
            self.restarts,
            self.health_check_failures,
            self.engine_version_drifts,
        )
        self.expired_pauses = Counter(
            "rlfleet_router_expired_pauses",
            "Engines the router sent /continue_generation itself, their pause having outlived its bound "
            "(--weight-update-timeout-secs) without one: whoever paused them (a trainer) died or lost it.",
            registry=self.registry,
        )
        # At 0 from the start, for the reason add_engine gives: a first update, routing decision or answer shows.
        for result in WEIGHT_UPDATE_RESULTS:
            self.weight_updates.labels(result=result)
        for reason in ROUTING_REASONS:
            self.routing_decisions.labels(reason=reason)
        for route in GENERATION_ROUTES:
            for status in GENERATION_STATUSES:
                self.requests.labels(route=route, status=status)
        self.fleet = FleetCollector(workers, weight_version)
        self.registry.register(self.fleet)
        # Children of the metrics every generation request updates, by label values in declaration order.
        self.request_count = Children(self.requests)
        self.request_timing = Children(self.request_seconds)
        self.routing_decision = Children(self.routing_decisions)

    def add_engine(self, url: str) -> None:
        """Creates an engine's labelled series at 0 as it joins: a counter's series that appears only at its
        first increment hides that increment from rate() and increase(), so a first restart or error would
        never show on a dashboard. Until then, and once `forget_engine` drops them, counts for it go nowhere."""
        self._moved_away.pop(url, None)
        for counter in self._engine_counters:
            counter.add(url)

    def forget_engine(self, url: str) -> None:
        """Drops the series of an engine that left the fleet: engines that come and go (pods by IP) would
        otherwise add series for as long as the router runs. What still finishes there later (requests in flight,
        a probe, a restart) counts nowhere, so nothing brings them back but the engine's return (`add_engine`)."""
        for counter in self._engine_counters:
            counter.forget(url)

    def engine_moved(self, old_url: str, new_url: str) -> None:
        """An engine restarted at `new_url`: its series start there, and those of `old_url` go after
        MOVED_ENGINE_SERIES_SECS (dropped at once, the restart just counted there would never be scraped)."""
        self.add_engine(new_url)
        self._moved_away[old_url] = time.monotonic() + MOVED_ENGINE_SERIES_SECS

    def _forget_moved_away(self) -> None:
        now = time.monotonic()
        for url, due in list(self._moved_away.items()):
            if due <= now:
                del self._moved_away[url]
                self.forget_engine(url)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.request_count(route, str(status)).inc()
        self.request_timing(route).observe(seconds)

    def exposition(self) -> bytes:
        self._forget_moved_away()
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts every HTTP request once its last byte is sent, so streamed responses are timed in full."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            # The route template, not the path, keeps the label set bounded (/workers/{worker_key}).
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe_request(route, status, time.perf_counter() - start)
