"""The chart's probes ask each service what Kubernetes should act on.

Liveness restarts a container, so it must not fail for something a restart does not fix: the router's
and the orchestrator's liveness probes are their /liveness (up while the process serves), never /health,
which is 503 while no engine is in routing (router) or Redis is down (orchestrator). /health stays their
readiness. Every trainer pod is probed on /health: each node's first rank serves it
(services/trainer/tests/test_node_health.py runs two nodes). Redis is ready once it answers PONG, not while it
loads its data.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.http_auth import OPEN_PATHS

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = sorted((REPO / "deploy" / "k8s" / "examples").glob("*.yaml"))


def containers(values_file: Path | None) -> dict[str, dict[str, Any]]:
    """component -> its (first) container, rendered with the chart's defaults and `values_file`."""
    values = helm.values_from_yaml(values_file.read_text()) if values_file else {}
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="rl", namespace="ml", is_install=True)
    docs = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    return {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc["spec"]["template"]["spec"]["containers"][0]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
    }


def probe_path(container: dict[str, Any], probe: str) -> str:
    path: str = container[probe]["httpGet"]["path"]
    return path


@pytest.mark.parametrize("values_file", [None, *EXAMPLES], ids=["defaults", *(p.stem for p in EXAMPLES)])
def test_liveness_is_liveness_and_readiness_is_health(values_file: Path | None) -> None:
    rendered = containers(values_file)
    for component in ("router", "rollout"):
        container = rendered[component]
        assert probe_path(container, "livenessProbe") == "/liveness", component
        assert probe_path(container, "readinessProbe") == "/health", component
        assert container["livenessProbe"]["httpGet"]["port"] == "http", component
    trainer = rendered["trainer"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe_path(trainer, probe) == "/health", probe
    # SGLang's /health generates a token, which waits behind a weight load: a long load would get the engine
    # killed. Its liveness is /get_model_info; the CPU engine's /health answers during a load.
    engine = rendered["engine"]
    expected = "/get_model_info" if engine_backend(values_file) == "sglang" else "/health"
    assert probe_path(engine, "livenessProbe") == expected
    assert probe_path(engine, "startupProbe") == probe_path(engine, "readinessProbe") == "/health"


def engine_backend(values_file: Path | None) -> str:
    values = yaml.safe_load(values_file.read_text()) if values_file else {}
    backend: str = (values.get("engine") or {}).get("backend") or yaml.safe_load((CHART / "values.yaml").read_text())[
        "engine"
    ]["backend"]
    return backend


def test_probes_need_no_api_token() -> None:
    # The orchestrator guards every path but the open ones; the router guards no GET.
    assert {"/liveness", "/health", "/metrics"} <= set(OPEN_PATHS)


def test_a_probe_path_set_in_values_wins() -> None:
    values = {"router": {"probes": {"liveness": {"path": "/health"}}}}
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        text = chart.render(values, name="rl", namespace="ml", is_install=True)["rlfleet/templates/router.yaml"]
    [router] = [doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "Deployment"]
    assert probe_path(router["spec"]["template"]["spec"]["containers"][0], "livenessProbe") == "/health"


def run_probe(command: list[str], env: dict[str, str]) -> int:
    """The exit status of an exec probe's command, run as the kubelet runs it (no shell unless it names one)."""
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def test_redis_is_ready_only_once_it_answers_pong(
    redis_cli_at: Callable[[int], dict[str, str]], loading_redis: int, ready_redis: int
) -> None:
    """While Redis loads its AOF it answers LOADING to every command, and `redis-cli ping` still exits 0: a readiness
    probe on that exit status sent clients to a Redis that could serve none of them. Liveness accepts LOADING: a restart
    would only begin the same load again."""
    redis = containers(None)["redis"]
    readiness, liveness = redis["readinessProbe"]["exec"]["command"], redis["livenessProbe"]["exec"]["command"]
    assert run_probe(readiness, redis_cli_at(loading_redis)) != 0
    assert run_probe(readiness, redis_cli_at(ready_redis)) == 0
    assert run_probe(liveness, redis_cli_at(loading_redis)) == 0
    assert run_probe(liveness, redis_cli_at(ready_redis)) == 0
