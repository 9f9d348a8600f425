"""The hub's Prometheus metrics, on a registry of their own (one per app, never the global one)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlfleet_reward.admission import Admission
from rlfleet_reward.sandbox_memory import MIB
from rlfleet_reward.worker_pool import JobStatus, WorkerPool

# Reward functions range from microseconds (string match) to seconds (symbolic math).
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RewardMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rlfleet_reward_requests",
            "Score requests by outcome (ok, cancelled, internal, or the error kind that refused the request).",
            ["outcome"],
            registry=self.registry,
        )
        self.items = Counter(
            "rlfleet_reward_items",
            "Scored (item, function) pairs by function and status (ok, error, timeout).",
            ["function", "status"],
            registry=self.registry,
        )
        self.item_seconds = Histogram(
            "rlfleet_reward_item_seconds",
            "Time one function took on one item (in the worker for pooled functions).",
            ["function"],
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.timeouts = Counter(
            "rlfleet_reward_timeouts",
            "Function calls that exceeded their time limit (one running in a worker process cost it a restart).",
            ["function"],
            registry=self.registry,
        )
        self.pool_workers = Gauge(
            "rlfleet_reward_pool_workers", "Live worker processes in the scoring pool.", registry=self.registry
        )
        self.pool_busy_workers = Gauge(
            "rlfleet_reward_pool_busy_workers", "Worker processes running a chunk of items now.", registry=self.registry
        )
        self.pool_queued_jobs = Gauge(
            "rlfleet_reward_pool_queued_jobs",
            "Function calls waiting for an idle worker; above zero the pool is saturated.",
            registry=self.registry,
        )
        self.pool_wait_seconds = Histogram(
            "rlfleet_reward_pool_wait_seconds",
            "Time a chunk of items queued for an idle worker before it started.",
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.admission_pending_jobs = Gauge(
            "rlfleet_reward_admission_pending_jobs",
            "(item, term) jobs of admitted requests, waiting for a worker or running; capped by max_pending_jobs.",
            registry=self.registry,
        )
        self.admission_waiting_requests = Gauge(
            "rlfleet_reward_admission_waiting_requests",
            "Requests waiting for room under max_pending_jobs; above zero the hub is full.",
            registry=self.registry,
        )
        self.code_memory_budget_bytes = Gauge(
            "rlfleet_reward_code_memory_budget_bytes",
            "Memory the code sandbox's tests may hold together, split evenly among the workers; 0: no budget (no "
            "container memory limit, nor code_memory_budget_mb).",
            registry=self.registry,
        )
        self.code_memory_held_bytes = Gauge(
            "rlfleet_reward_code_memory_held_bytes",
            "Memory the code sandbox's running tests may hold together now (each test's memory_mb x max_processes, "
            "or its worker's share of the budget when that is less); within the budget when there is one.",
            registry=self.registry,
        )
        self.io_calls_in_flight = Gauge(
            "rlfleet_reward_io_calls_in_flight",
            "Network-bound function calls (remote, judge) running on the event loop now.",
            registry=self.registry,
        )

    def add_functions(self, names: Iterable[str]) -> None:
        """Creates each function's series, and the common request outcomes', at 0: a counter series that appears
        only at its first increment hides that increment from rate() and increase(), so a first timeout or
        error would never show on a dashboard."""
        for outcome in (
            "ok",
            "cancelled",
            "internal",
            "invalid_input",
            "resource_exhausted",
            "overloaded",
            "unavailable",
        ):
            self.requests.labels(outcome)
        for name in names:
            for status in JobStatus:
                self.items.labels(name, status.value)
            self.timeouts.labels(name)
            self.item_seconds.labels(name)

    def watch_pool(self, pool: WorkerPool) -> None:
        """Reads the pool's gauges at scrape time and times its waits, so the pool knows nothing of metrics."""
        self.pool_workers.set_function(lambda: pool.live)
        self.pool_busy_workers.set_function(lambda: pool.busy)
        self.pool_queued_jobs.set_function(lambda: pool.waiting)
        budget = pool.memory_budget
        # The budget itself, not its workers' shares summed: a share rounded down to 0 would read as no budget.
        self.code_memory_budget_bytes.set(max(0, budget.total_mb) * MIB if budget is not None else 0)
        self.code_memory_held_bytes.set_function(lambda: pool.sandbox_memory_held)
        pool.on_wait = self.pool_wait_seconds.observe

    def watch_admission(self, admission: Admission) -> None:
        """Reads the admission's gauges at scrape time."""
        self.admission_pending_jobs.set_function(lambda: admission.pending)
        self.admission_waiting_requests.set_function(lambda: admission.waiting)
