"""deploy/grafana: well-formed dashboards whose every query names only metrics some service exports,
and a Prometheus config that Prometheus's own checker accepts. (test_dashboards_e2e.py evaluates
every query against a running fleet.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
METRIC = re.compile(r"\b(rlfleet_[a-z_]+|sglang:[a-z_]+)")
# Suffixes Prometheus client libraries add to counters and histograms.
SUFFIXES = ("_total", "_bucket", "_count", "_sum")
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
    ],
    "rlfleet-fleet.json": ["routing", "restarts", "load", "cache hit", "queue", "weight version", "router latency"],
    "rlfleet-stream.json": ["lag", "produced"],
    "rlfleet-reward.json": ["per second", "errors", "latency by function", "timeouts"],
}


def exported_metric_names() -> set[str]:
    """Names declared in the services' metrics modules (the engine's SGLang-named ones included)."""
    names: set[str] = set()
    for path in REPO.glob("services/*/rlfleet_*/metrics.py"):
        names |= set(re.findall(r'"(rlfleet_[a-z_]+|sglang:[a-z_]+)"', path.read_text()))
        # The trainer names its step gauges from a table: rlfleet_trainer_<name>.
        names |= {f"rlfleet_trainer_{n}" for n in re.findall(r'^\s+"([a-z_]+)": "', path.read_text(), re.M)}
    return names


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
def test_every_query_names_exported_metrics(path: Path) -> None:
    exported = exported_metric_names()
    assert "sglang:num_queue_reqs" in exported and "rlfleet_trainer_entropy" in exported
    for title, target in targets(json.loads(path.read_text())):
        names = METRIC.findall(target["expr"])
        assert names, f"{title}: {target['expr']}"
        for name in names:
            base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
            # Counters may be declared with their _total suffix (the trainer's are).
            assert base in exported or name in exported, f"{path.name} / {title}: {name} is not exported"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_compose_prometheus_config_passes_promtool() -> None:
    config = REPO / "deploy" / "compose" / "prometheus.yml"
    result = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
