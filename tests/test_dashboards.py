"""The Grafana dashboards (deploy/grafana) chart only series the services export, with functions that fit
their types: a renamed metric or a rate() over a gauge would leave a panel empty or wrong without a word."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from rlfleet_engine.metrics import EngineMetrics
from rlfleet_reward.metrics import RewardMetrics
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.workers import WorkerRegistry
from rlfleet_trainer.metrics import TrainerMetrics

DASHBOARDS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "grafana").glob("*.json"))
SERIES = re.compile(r"\b(?:rlfleet_[a-z0-9_]+|sglang:[a-z0-9_:]+)")
RATE_OF = re.compile(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exported() -> dict[str, str]:
    """Every series name the services export (with its type's suffixes) -> the metric's type."""
    engine_registry = CollectorRegistry()
    EngineMetrics(engine_registry, "model")
    registries = [
        RouterMetrics(WorkerRegistry(failure_threshold=3, success_threshold=1), lambda: "1").registry,
        RewardMetrics().registry,
        TrainerMetrics().registry,
        RolloutMetrics().registry,
        engine_registry,
    ]
    names: dict[str, str] = {}
    for registry in registries:
        for family in registry.collect():
            for suffix in SUFFIXES.get(family.type, ("",)):
                names[family.name + suffix] = family.type
    return names


def expressions(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    board = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", []) if t.get("expr")]


def test_there_are_dashboards_to_check() -> None:
    assert {p.name for p in DASHBOARDS} >= {"rlfleet-run.json", "rlfleet-fleet.json", "rlfleet-stream.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_series_a_dashboard_charts_is_exported_and_rated_only_if_a_counter(path: Path) -> None:
    names = exported()
    for title, expr in expressions(path):
        for series in SERIES.findall(expr):
            assert series in names, f"{path.name} / {title}: {series} is not exported by any service ({expr})"
        for series in RATE_OF.findall(expr):
            kind = names.get(series, "")
            assert kind in ("counter", "histogram", "summary") and not series.endswith("_created"), (
                f"{path.name} / {title}: rate over {series}, a {kind or 'missing series'} ({expr})"
            )
