"""deploy/prometheus: the alert rules pass promtool's checks and their unit tests (each alert fires on what should
raise it and on nothing else), query only series the services export, and reach Prometheus the same way in
compose (rule_files, the rlfleet_service label on every target) and in Kubernetes (a PrometheusRule, the label set
by every ServiceMonitor)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from exported_series import exported, labels_not_exported  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rlfleet-alerts.yml"
COMPOSE = REPO / "deploy" / "compose"
SERVICES = ["engine", "router", "reward", "rollout", "trainer"]
# A series name, not a label (rlfleet_service="..."); names inside __name__=~"a|b" count too.
SERIES = re.compile(r"\b(rlfleet_[a-z0-9_]+|sglang:[a-z0-9_:]+)\b(?!\s*(?:=~|!~|!=|=)\s*[\"'`])")
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (apt-get install prometheus)"
)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_the_rules_pass_promtool_and_their_unit_tests() -> None:
    checked = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        ["promtool", "test", "rules", RULES.with_suffix(".test.yml").name],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_unit_tested_and_queries_exported_series() -> None:
    names = exported()
    tests = yaml.safe_load(RULES.with_suffix(".test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case.get("exp_alerts")}
    for rule in rules():
        assert rule["alert"] in fired, f"{rule['alert']} never fires in rlfleet-alerts.test.yml"
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        for series in SERIES.findall(rule["expr"]):
            assert series in names, f"{rule['alert']}: {series} is not exported by any service"
        used = rule["expr"] + rule["annotations"]["summary"] + rule["annotations"]["description"]
        wrong = labels_not_exported(rule["expr"], re.sub(r"\$labels\.(\w+)", r"{{\1}}", used))
        assert not wrong, f"{rule['alert']}: labels {wrong} are on none of its series"


def test_compose_prometheus_loads_the_rules_and_labels_every_target() -> None:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    mounted = {
        entry["target"]: (COMPOSE / compose["configs"][entry["source"]]["file"]).resolve()
        for entry in compose["services"]["prometheus"]["configs"]
    }
    assert [mounted[path] for path in config["rule_files"]] == [RULES]
    labelled = {
        job["job_name"]: [target["labels"]["rlfleet_service"] for target in job["static_configs"]]
        for job in config["scrape_configs"]
    }
    assert labelled == {service: [service] for service in SERVICES}


def test_the_chart_ships_the_rules_and_every_service_monitor_sets_the_label() -> None:
    helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")
    helm.disable_logging()
    with helm.Chart.load(str(REPO / "deploy" / "k8s" / "rlfleet")) as chart:
        files = chart.render({"alerts": {"labels": {"release": "monitoring"}}}, name="rl", namespace="ml")
        without = chart.render({"alerts": {"enabled": False}}, name="rl", namespace="ml")
    docs = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    [rule] = [doc for doc in docs if doc["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "monitoring"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    monitors = [doc for doc in docs if doc["kind"] == "ServiceMonitor"]
    labelled = sorted(
        relabel["replacement"]
        for monitor in monitors
        for endpoint in monitor["spec"]["endpoints"]
        for relabel in endpoint["relabelings"]
        if relabel["targetLabel"] == "rlfleet_service"
    )
    assert labelled == sorted(SERVICES)
    assert not any("PrometheusRule" in text for text in without.values())
