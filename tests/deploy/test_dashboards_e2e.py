"""Every PromQL expression of every dashboard panel returns series from a real Prometheus scraping a real
fleet that has just trained a short run. Prometheus is Debian's (`apt-get install prometheus`)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rlfleet.local_fleet import LocalFleet
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.runs_client import FINAL_STATES, RunsClient
from rlfleet.v1.runs_pb2 import RunState

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="prometheus not installed (apt-get install prometheus)"
    ),
]

REPO = Path(__file__).resolve().parents[2]
# What Grafana substitutes for its variables: the run is short, so one minute covers it; every namespace
# (the local fleet's series have none, as in docker compose).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s", "$namespace": ".*"}


def scrape_config(fleet: LocalFleet) -> dict[str, Any]:
    """deploy/compose/prometheus.yml with its targets moved to the local fleet, 1 s scrapes, and the alert rules."""
    config = yaml.safe_load((REPO / "deploy" / "compose" / "prometheus.yml").read_text())
    p = fleet.config.ports
    local = {
        "engine": [f"127.0.0.1:{p.engine_base + i}" for i in range(fleet.config.engines)],
        "router": [f"127.0.0.1:{p.router}"],
        "reward": [f"127.0.0.1:{p.reward}"],
        "rollout": [f"127.0.0.1:{p.rollout}"],
        "trainer": [f"127.0.0.1:{p.trainer_http}"],
    }
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(REPO / "deploy" / "prometheus" / "rlfleet-alerts.yml")]  # mounted there in compose
    for job in config["scrape_configs"]:
        [static] = job["static_configs"]
        job["static_configs"] = [{"targets": local.pop(job["job_name"]), "labels": static["labels"]}]
    assert not local, f"compose's prometheus.yml scrapes no {sorted(local)}"
    return config


@pytest.fixture(scope="module")
def prometheus(fleet: LocalFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(fleet)))
    port = free_port()
    process = ServiceProcess(
        "prometheus",
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        work / "prometheus.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_healthy(f"{url}/-/ready", timeout=30)
        deadline = time.monotonic() + 30
        while True:
            active = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            if len(active) == 6 and all(t["health"] == "up" for t in active):
                break
            assert time.monotonic() < deadline, f"targets not all up: {[(t['scrapeUrl'], t['health']) for t in active]}"
            time.sleep(0.5)
        yield url
    finally:
        process.stop(timeout=10)


@pytest.fixture(scope="module")
def after_a_short_run(fleet: LocalFleet, prometheus: str) -> str:
    spec = {
        "model": {"path": str(fleet.config.model_path)},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 8},
        "rollout": {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "schedule": {"steps": 3, "eval_every": 2},
    }
    client = RunsClient(fleet.api_url, timeout_s=30)
    response = httpx.post(f"{fleet.api_url}/v1/runs", json=spec, timeout=30)
    assert response.status_code == 200, response.text
    run_id = response.json()["id"]
    deadline = time.monotonic() + 120
    while (run := client.get(run_id)).state not in FINAL_STATES:
        assert time.monotonic() < deadline, f"run {run_id} did not finish"
        time.sleep(0.5)
    assert run.state == RunState.RUN_STATE_SUCCEEDED, run.error
    time.sleep(3)  # a few scrapes after the last step
    return prometheus


def panel_queries() -> list[tuple[str, str, str]]:
    queries = []
    for path in sorted((REPO / "deploy" / "grafana").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                queries.append((path.stem, panel["title"], target["expr"]))
    return queries


def test_every_panel_query_returns_series(after_a_short_run: str) -> None:
    empty, errors = [], []
    for dashboard, title, expr in panel_queries():
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        body = httpx.get(f"{after_a_short_run}/api/v1/query", params={"query": expr}, timeout=10).json()
        if body["status"] != "success":
            errors.append(f"{dashboard} / {title}: {expr}: {body.get('error')}")
        elif not body["data"]["result"]:
            empty.append(f"{dashboard} / {title}: {expr}")
    assert not errors, "\n".join(errors)
    assert not empty, "queries without series:\n" + "\n".join(empty)


def test_the_run_shows_on_the_dashboards(after_a_short_run: str) -> None:
    def value(expr: str) -> float:
        body = httpx.get(f"{after_a_short_run}/api/v1/query", params={"query": expr}, timeout=10).json()
        return float(body["data"]["result"][0]["value"][1])

    assert value("max(rlfleet_trainer_step)") >= 3
    assert value("sum(rlfleet_rollout_groups_produced_total)") >= 6
    assert value("sum(rlfleet_router_engine_healthy)") == 2
    assert value("max(rlfleet_trainer_weight_version) - max(rlfleet_router_weight_version)") == 0


def test_the_alerts_evaluate_and_none_fires_on_a_healthy_fleet(after_a_short_run: str) -> None:
    groups = httpx.get(f"{after_a_short_run}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == 8 and all(rule["type"] == "alerting" for rule in rules)
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
    assert [(r["name"], r["alerts"]) for r in rules if r["state"] == "firing"] == []
