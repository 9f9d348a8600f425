"""What a user sets in the chart's values reaches every pod as set: a component's `env` overrides the variables the
chart sets (one entry per name, the user's value), and `imagePullSecrets` applies to every pod.

A container with two env entries of one name is refused by server-side apply (Helm 4's default: duplicate keys of
a list merged by name), and Helm 3's three-way merge of such a list drops or keeps entries unpredictably on upgrade.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = sorted((REPO / "deploy" / "k8s" / "examples").glob("*.yaml"))

# For each component, variables the chart sets itself, each given another value, and one it does not set.
OVERRIDES: dict[str, dict[str, str]] = {
    "router": {
        "RLFLEET_ROUTER_RESTART_TIMEOUT_SECS": "900",
        "RLFLEET_ROUTER_POLICY": "round_robin",
        "RLFLEET_ROUTER_LOG_LEVEL": "debug",
    },
    "trainer": {
        "RLFLEET_TRAINER_WORK_DIR": "/data/elsewhere",
        "RLFLEET_TRAINER_SHUTDOWN_TIMEOUT_S": "200",
        "RLFLEET_TRAINER_WEIGHT_SYNC": "distributed",
        "RLFLEET_TRAINER_WEIGHT_SYNC_ADDRESS": "trainer-0.example",
    },
    "rollout": {"RLFLEET_ROLLOUT_REWARD_URL": "http://remote-reward:8001", "RLFLEET_ROLLOUT_LOG_LEVEL": "debug"},
    "reward": {"RLFLEET_REWARD_WORKERS": "8", "RLFLEET_REWARD_LOG_LEVEL": "debug"},
    "engine": {"RLFLEET_ENGINE_WEIGHT_VERSION": "3", "RLFLEET_ENGINE_TORCH_THREADS": "2"},
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="rl", namespace="ml", is_install=True)
    return [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> its pod spec (Deployments, StatefulSets and Jobs)."""
    return {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def repeated_env_names(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    repeated = {}
    for component, spec in pods(docs).items():
        for container in spec["containers"]:
            counts = Counter(var["name"] for var in container.get("env", []))
            if names := sorted(name for name, n in counts.items() if n > 1):
                repeated[f"{component}/{container['name']}"] = names
    return repeated


@pytest.mark.parametrize("values_file", [None, *EXAMPLES], ids=["defaults", *(p.stem for p in EXAMPLES)])
def test_every_container_sets_each_variable_once(values_file: Path | None) -> None:
    values = helm.values_from_yaml(values_file.read_text()) if values_file else {}
    assert repeated_env_names(render(values)) == {}


def test_a_components_env_overrides_the_variables_the_chart_sets() -> None:
    # Two trainer nodes: the chart's PET_NODE_RANK (a valueFrom entry) is kept beside the user's entries.
    values: dict[str, Any] = {component: {"env": env} for component, env in OVERRIDES.items()}
    values["trainer"]["nodes"] = 2
    docs = render(values)
    assert repeated_env_names(docs) == {}
    specs = pods(docs)
    for component, env in OVERRIDES.items():
        rendered = {var["name"]: var for var in specs[component]["containers"][0]["env"]}
        assert {name: rendered[name].get("value") for name in env} == env, component
        prefix = f"RLFLEET_{component.upper()}_"
        assert len([name for name in rendered if name.startswith(prefix)]) > len(env), f"{component} lost the chart's"
    trainer = {var["name"]: var for var in specs["trainer"]["containers"][0]["env"]}
    assert trainer["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert trainer["RLFLEET_TRAINER_GRPC_PORT"]["value"] == "50052"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
        except kubernetes_validate.utils.SchemaNotFoundError:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", doc["kind"]


def test_image_pull_secrets_reach_every_pod() -> None:
    secrets = [{"name": "registry-credentials"}]
    specs = pods(render({"imagePullSecrets": secrets}))
    assert {"router", "trainer", "rollout", "reward", "engine", "redis", "model-init"} <= set(specs)
    assert {component: spec.get("imagePullSecrets") for component, spec in specs.items()} == dict.fromkeys(
        specs, secrets
    )


def test_a_list_or_mapping_in_env_reaches_the_service_as_json() -> None:
    """The services read list and mapping variables as JSON; a YAML list was written [http://rm:8080/score] and
    the reward hub refused to start."""
    values = {
        "reward": {"env": {"RLFLEET_REWARD_REMOTE_URL_PREFIXES": ["http://rm:8080/score"]}},
        "rollout": {"env": {"RLFLEET_ROLLOUT_DATA_ROOTS": ["/data", "/datasets"], "RLFLEET_ROLLOUT_LOG_LEVEL": 10}},
        "trainer": {"env": None},
    }
    specs = pods(render(values))
    reward = {var["name"]: var.get("value") for var in specs["reward"]["containers"][0]["env"]}
    rollout = {var["name"]: var.get("value") for var in specs["rollout"]["containers"][0]["env"]}
    assert reward["RLFLEET_REWARD_REMOTE_URL_PREFIXES"] == '["http://rm:8080/score"]'
    assert (
        rollout["RLFLEET_ROLLOUT_DATA_ROOTS"] == '["/data","/datasets"]'
        and rollout["RLFLEET_ROLLOUT_LOG_LEVEL"] == "10"
    )
    assert "trainer" in specs  # a null env is no env


def test_the_examples_prometheus_rules_carry_the_label_their_service_monitors_do() -> None:
    """kube-prometheus-stack selects PrometheusRules by the label it selects ServiceMonitors by: an example that
    labels only its ServiceMonitors loads none of the alerts."""
    for path in EXAMPLES:
        docs = render(helm.values_from_yaml(path.read_text()))
        monitors = [doc["metadata"]["labels"] for doc in docs if doc["kind"] == "ServiceMonitor"]
        rules = [doc["metadata"]["labels"] for doc in docs if doc["kind"] == "PrometheusRule"]
        if monitors and rules and "release" in monitors[0]:
            assert all(labels.get("release") == monitors[0]["release"] for labels in rules), path.name
