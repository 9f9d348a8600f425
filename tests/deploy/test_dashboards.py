"""deploy/grafana: well-formed dashboards whose every query charts series some service exports (rates over
counters only), scoped to the chosen namespace, and a Prometheus config that Prometheus's own checker
accepts. (test_dashboards_e2e.py evaluates every query against a running fleet.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from exported_series import exported, labels_not_exported  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
# A series name, not a label named like one (`up{rlfleet_service!=""}`).
METRIC = re.compile(r"\b(rlfleet_[a-z0-9_]+|sglang:[a-z0-9_:]+)\b(?!\s*(?:=~|!~|!=|=)\s*[\"'`])")
SELECTOR = re.compile(r"\b(?:rlfleet_[a-z0-9_]+|sglang:[a-z0-9_:]+)\b(?!\s*(?:=~|!~|!=|=)\s*[\"'`])(\{[^}]*\})?")
RATE_OF = re.compile(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
REQUIRED_PANELS = {
    "rlfleet-run.json": [
        "reward",
        "eval accuracy",
        "kl",
        "entropy",
        "loss",
        "clip",
        "step time",
        "tokens",
        "staleness",
        "pass@k",
        "checkpoint time",
    ],
    "rlfleet-fleet.json": [
        "routing",
        "restarts",
        "load",
        "cache hit",
        "queue",
        "weight version",
        "router latency",
        "pauses the router ended",
        "routing decisions",
        "added latency",
        "engine states",
        "engine errors",
        "prefix tree",
        "between tokens",
        "services up",
    ],
    "rlfleet-stream.json": ["lag", "produced", "resumed", "turns per multi-turn episode"],
    "rlfleet-reward.json": ["per second", "errors", "latency by function", "timeouts", "waiting for a worker"],
}


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], target) for panel in dashboard["panels"] for target in panel["targets"]]


def test_there_is_a_dashboard_for_run_fleet_stream_and_reward() -> None:
    assert [path.name for path in DASHBOARDS] == sorted(REQUIRED_PANELS)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_well_formed(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] == path.stem and dashboard["title"].startswith("rlfleet / ")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    titles = " | ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in REQUIRED_PANELS[path.name]:
        assert topic in titles, f"{path.name} has no panel about {topic}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_charts_exported_series_and_rates_only_counters(path: Path) -> None:
    """A renamed metric or label, or a rate() over a gauge, would leave a panel empty or wrong without a word."""
    names = exported()
    assert "sglang:num_queue_reqs" in names and "rlfleet_trainer_entropy" in names
    for title, target in targets(json.loads(path.read_text())):
        expr = target["expr"]
        # Prometheus's own `up`, of the fleet's targets (which carry rlfleet_service), or the services' series.
        assert METRIC.findall(expr) or expr.startswith('up{rlfleet_service!=""'), f"{title}: {expr}"
        for series in METRIC.findall(expr):
            assert series in names, f"{path.name} / {title}: {series} is not exported by any service ({expr})"
        for series in RATE_OF.findall(expr):
            kind = names.get(series, "missing series")
            assert kind in ("counter", "histogram"), f"{path.name} / {title}: rate over {series}, a {kind} ({expr})"
        wrong = labels_not_exported(expr, target.get("legendFormat", ""))
        assert not wrong, f"{path.name} / {title}: labels {wrong} are on none of its series ({expr})"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_series_is_scoped_to_the_chosen_namespace(path: Path) -> None:
    """Prometheus in a cluster scrapes every release: unscoped sums would add up other namespaces' fleets."""
    dashboard = json.loads(path.read_text())
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "namespace"]
    assert variable["includeAll"] and variable["allValue"] == ".*"  # compose's series have no namespace label
    for title, target in targets(dashboard):
        for match in SELECTOR.finditer(target["expr"]):
            assert match.group(1) and 'namespace=~"$namespace"' in match.group(1), f"{path.name} / {title}"


# Events minutes apart: a window of a few scrapes ($__rate_interval, about 20 s) holds none most of the time, and the
# panel showed "No data" but for the moments just after a step or a checkpoint ended.
RARE_EVENTS = (
    "rlfleet_trainer_step_seconds",
    "rlfleet_trainer_weight_sync_seconds",
    "rlfleet_trainer_checkpoint_seconds",
    "rlfleet_rollout_group_staleness",
)
RANGE = re.compile(r"\[(\d+)m\]")


def test_queries_of_events_minutes_apart_look_back_minutes() -> None:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "rlfleet-run.json").read_text())
    rare = [(title, t["expr"]) for title, t in targets(dashboard) if any(e in t["expr"] for e in RARE_EVENTS)]
    assert rare
    for title, expr in rare:
        windows = [int(minutes) for minutes in RANGE.findall(expr)]
        assert windows and min(windows) >= 10 and "$__rate_interval" not in expr, (title, expr)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_compose_prometheus_config_passes_promtool() -> None:
    config = REPO / "deploy" / "compose" / "prometheus.yml"
    result = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
