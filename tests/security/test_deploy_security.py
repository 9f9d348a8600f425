"""Compose and Helm configure the API token by default and keep engines and Redis inside the fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose"
TOKEN_USERS = {"router": "RLFLEET_ROUTER_", "rollout": "RLFLEET_ROLLOUT_", "trainer": "RLFLEET_TRAINER_"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def test_compose_generates_the_token_and_every_user_reads_it(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "RLFLEET_API_TOKEN=" not in (COMPOSE / ".env").read_text(), "a fixed token is committed in .env"
    init = services["api-token"]
    assert "secrets.token_urlsafe" in init["command"][0] and "chmod(0o400)" in init["command"][0]
    mount = next(v for v in init["volumes"] if v.startswith("api-token:"))
    token_path = mount.split(":")[1] + "/api_token"
    for name in ("router", "rollout", "trainer", "trainer-gpu", "demo"):
        service = services[name]
        env = service["environment"]
        key = "RLFLEET_API_TOKEN_FILE" if name == "demo" else TOKEN_USERS[name.split("-")[0]] + "API_TOKEN_FILE"
        assert env[key] == token_path, name
        assert f"api-token:{mount.split(':')[1]}:ro" in service["volumes"], name
    for name in ("router", "rollout", "trainer"):
        assert services[name]["depends_on"]["api-token"]["condition"] == "service_completed_successfully"


def test_compose_keeps_engines_redis_and_the_trainer_off_the_outside(compose: dict[str, Any]) -> None:
    assert compose["networks"]["default"]["internal"] is True
    assert not compose["networks"]["edge"].get("internal")
    outside = set()
    for name, service in compose["services"].items():
        networks = service.get("networks") or {"default": {}}
        if "edge" in networks:
            outside.add(name)
        if service.get("ports"):
            assert "edge" in networks, f"{name} publishes a port but is on the internal network only"
            assert all(p.startswith("127.0.0.1:") for p in service["ports"]), f"{name} publishes beyond loopback"
    assert outside == {"router", "rollout", "reward", "prometheus", "grafana"}
    assert "default" not in compose["services"]["grafana"]["networks"]


def _render() -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")
    helm.disable_logging()
    with helm.Chart.load(str(REPO / "deploy" / "k8s" / "rlfleet")) as chart:
        files = chart.render({}, name="rl", namespace="ml", is_install=True)
    return [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def test_helm_mounts_the_generated_token_where_each_service_reads_it() -> None:
    docs = _render()
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "rl-rlfleet-api-token")
    assert len(secret["data"]["token"]) >= 40
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in workloads}
    for component, prefix in TOKEN_USERS.items():
        spec = pods[f"rl-rlfleet-{component}"]
        container = spec["containers"][0]
        path = next(e["value"] for e in container["env"] if e["name"] == f"{prefix}API_TOKEN_FILE")
        mount = next(m for m in container["volumeMounts"] if m["name"] == "api-token")
        volume = next(v for v in spec["volumes"] if v["name"] == "api-token")
        assert mount["readOnly"] is True
        assert path == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}", component
        assert volume["secret"]["secretName"] == "rl-rlfleet-api-token"
    for component in ("engine", "reward"):
        assert not any(v["name"] == "api-token" for v in pods[f"rl-rlfleet-{component}"].get("volumes", []))


def test_helm_network_policies_admit_only_fleet_callers_to_engines_and_redis() -> None:
    policies = {d["metadata"]["name"]: d["spec"] for d in _render() if d["kind"] == "NetworkPolicy"}
    for component, callers in (("engine", {"router", "trainer"}), ("redis", {"rollout", "trainer"})):
        spec = policies[f"rl-rlfleet-{component}"]
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        fleet_rule = spec["ingress"][0]
        admitted = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in fleet_rule["from"]}
        assert admitted == callers
        assert all("namespaceSelector" not in p for p in fleet_rule["from"])
        # Anything else (engines' metrics scrape) comes only from the monitoring namespace.
        for rule in spec["ingress"][1:]:
            assert all("namespaceSelector" in p for p in rule["from"]), rule
    assert len(policies["rl-rlfleet-redis"]["ingress"]) == 1, "Redis takes no traffic but the fleet's"
