"""The series every rlfleet service exports, for the tests of what the dashboards and alerts query."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlfleet_engine.metrics import EngineMetrics
from rlfleet_reward.metrics import RewardMetrics
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.trajectory_store import TrajectoryStore
from rlfleet_router.workers import WorkerRegistry
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.stream_lag import scrape_client

# Series names prometheus_client exports per metric type.
TYPE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> dict[str, str]:
    """Every series name the services export (with its type's suffixes: _total, _bucket, ...) -> its type."""
    engine_registry = CollectorRegistry()
    EngineMetrics(engine_registry, "model")
    trainer = TrainerMetrics()
    # Rank 0 reads the stream lag at each scrape once it serves (no run here: NaN, no Redis asked).
    trainer.watch_stream_lag(scrape_client("redis://127.0.0.1:9"), "", lambda: None)
    router = RouterMetrics(WorkerRegistry(failure_threshold=3, success_threshold=1), lambda: "1")
    router.fleet.trajectories = TrajectoryStore(max_tokens=1, max_update_lag=0)  # every router has one (fleet.py)
    registries = [
        router.registry,
        RewardMetrics().registry,
        trainer.registry,
        RolloutMetrics().registry,
        engine_registry,
    ]
    names: dict[str, str] = {}
    for registry in registries:
        for family in registry.collect():
            for suffix in TYPE_SUFFIXES.get(family.type, ("",)):
                names[family.name + suffix] = family.type
    return names
