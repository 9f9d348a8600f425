"""The series every rlfleet service exports, for the tests of what the dashboards and alerts query.

Each registry is built as its service builds it, with the metrics its other parts register beside metrics.py
(the router's weight sync and busy engines, the trainer's rank ops, the API token guards), so a panel over one of
them is checked too. Labelled series that a service creates only as things happen (an engine joins, a weight
sync ends) are made to exist here once each, so their label names are known.
"""

from __future__ import annotations

import functools
import re

from prometheus_client import CollectorRegistry

from rlfleet.api_token import ApiTokenGuard
from rlfleet_engine.metrics import EngineMetrics
from rlfleet_reward.metrics import RewardMetrics
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_router.config import RouterConfig
from rlfleet_router.http_app import create_app
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.rank_group import RankGroup
from rlfleet_trainer.rank_ops import RANK_OPS
from rlfleet_trainer.stream_lag import scrape_client

# Series names prometheus_client exports per metric type.
TYPE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
# Labels Prometheus adds to every series it scrapes: the target's (compose: job, instance and the static
# rlfleet_service; Kubernetes: the ServiceMonitor's, namespace and pod among them).
TARGET_LABELS = frozenset(
    {"job", "instance", "rlfleet_service", "namespace", "pod", "service", "endpoint", "container"}
)
ENGINE = "http://127.0.0.1:9"


def _registries() -> list[CollectorRegistry]:
    engine_registry = CollectorRegistry()
    EngineMetrics(engine_registry, "model")
    trainer = TrainerMetrics()
    # Rank 0 reads the stream lag at each scrape once it serves (no run here: NaN, no Redis asked).
    trainer.watch_stream_lag(scrape_client("redis://127.0.0.1:9"), "", lambda: None)
    RankGroup(RANK_OPS, object(), registry=trainer.registry)  # rank 0's ops, on the registry it shares (__main__)
    router = create_app(RouterConfig(worker_urls=[ENGINE])).fleet
    router.metrics.add_engine(ENGINE)
    router.weights.sync_seconds.labels(path="disk")
    router.metrics.request_seconds.labels(route="/generate")
    router.weights.busy.start_loading(router.workers.all())
    rollout = RolloutMetrics()
    ApiTokenGuard(None, rollout.registry, "rollout")
    reward = RewardMetrics()
    reward.add_functions(["exact_match"])
    rollout.add_filter_reasons(["zero_variance"])
    rollout.set_run_counts({})
    return [router.metrics.registry, reward.registry, trainer.registry, rollout.registry, engine_registry]


@functools.cache
def _series() -> dict[str, tuple[str, frozenset[str] | None]]:
    series: dict[str, tuple[str, frozenset[str] | None]] = {}
    for registry in _registries():
        for family in registry.collect():
            for suffix in TYPE_SUFFIXES.get(family.type, ("",)):
                name = family.name + suffix
                samples = [sample for sample in family.samples if sample.name == name]
                labels = frozenset(label for sample in samples for label in sample.labels) if samples else None
                series[name] = (family.type, labels)
    return series


def exported() -> dict[str, str]:
    """Every series name the services export (with its type's suffixes: _total, _bucket, ...) -> its type."""
    return {name: kind for name, (kind, _) in _series().items()}


def exported_labels() -> dict[str, frozenset[str] | None]:
    """Every series name the services export -> the label names its samples carry (before the target's), None for
    a labelled metric with no series here (its labels unknown)."""
    return {name: labels for name, (_, labels) in _series().items()}


# A series name, not a label named like one (`up{rlfleet_service!=""}`); names inside __name__=~"a|b" count too.
SERIES = re.compile(r"\b(rlfleet_[a-z0-9_]+|sglang:[a-z0-9_:]+)\b(?!\s*(?:=~|!~|!=|=)\s*[\"'`])")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def labels_not_exported(expr: str, legend: str = "") -> list[str]:
    """The label names `expr` (and its legend) use that neither its series nor the scrape target carry: a matcher
    on one selects nothing, a grouping by one puts every series in one group, a legend shows it empty."""
    labels = exported_labels()
    known = [labels.get(name) for name in SERIES.findall(expr)]
    if any(names is None for names in known):
        return []  # a series missing altogether is reported by the name check; labels unknown: nothing to check
    carried = set(TARGET_LABELS).union(*[names for names in known if names is not None])
    unquoted = _QUOTED.sub('""', expr)
    wrong: list[str] = []
    for name, matchers in _SELECTOR.findall(unquoted):
        own = labels.get(name) if name else None
        allowed = TARGET_LABELS | own if own is not None else carried
        wrong += [label for label in _MATCHER.findall(matchers) if label != "__name__" and label not in allowed]
    for grouping in _GROUPING.findall(unquoted):
        wrong += [label for label in re.split(r"\s*,\s*", grouping.strip()) if label and label not in carried]
    wrong += [label for label in _LEGEND.findall(legend) if label not in carried]
    return wrong
