"""What the chart's NetworkPolicies let through, evaluated as Kubernetes does for a given source and port.

- Trainer pods reach each other on every port: torchrun's gloo and NCCL collectives listen on random ones.
- With the distributed weight sync (trainer.env RLFLEET_TRAINER_WEIGHT_SYNC=distributed) the trainer and
  every engine form one process group, so they reach each other on every port; with the disk sync
  (the default) engines reach no trainer port and no other engine.
- `networkPolicy.apiFrom` narrows who reaches the Runs API, never the release's own pods nor the
  scrapes, which every service admits on its metrics port: by default the monitoring namespace's Prometheus
  pods, not its other pods (the metrics port is the API port, and engines and the reward hub check no token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = REPO / "deploy" / "k8s" / "examples"
RELEASE, NAMESPACE = "rl", "ml"
DISTRIBUTED = {"env": {"RLFLEET_TRAINER_WEIGHT_SYNC": "distributed"}}
RANDOM_PORT = 41873  # any port a collective may listen on
METRICS_PORTS = {"engine": 30000, "router": 30000, "reward": 8001, "trainer": 8002, "rollout": 8000}


@dataclass(frozen=True)
class Source:
    """A pod that opens a connection: its namespace's labels and its own."""

    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    namespace_extra_labels: dict[str, str] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_extra_labels}


def fleet_pod(component: str, release: str = RELEASE) -> Source:
    labels = {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": release}
    return Source(NAMESPACE, {**labels, "app.kubernetes.io/component": component})


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"this evaluator reads matchLabels only: {selector}"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], source: Source) -> bool:
    assert "ipBlock" not in peer, "this evaluator knows pods, not address blocks"
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != NAMESPACE:  # a podSelector alone selects in the policy's own namespace
        return False
    return _selects(peer.get("podSelector", {}), source.labels)


def admits(policy: dict[str, Any], source: Source, port: int) -> bool:
    """Whether `policy` (ingress) lets `source` connect to `port` of the pods it selects."""
    for rule in policy["spec"].get("ingress", []):
        peers, ports = rule.get("from"), rule.get("ports")
        if peers and not any(_peer_matches(peer, source) for peer in peers):
            continue
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        return True
    return False


def policies(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The release's NetworkPolicies by component, rendered with `values`."""
    helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    return {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc for doc in docs if doc["kind"] == "NetworkPolicy"
    }


def example(name: str, **overrides: dict[str, Any]) -> dict[str, Any]:
    """The values of examples/`name`, with `overrides` merged into its sections."""
    values: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    for section, override in overrides.items():
        values[section] = {**values.get(section, {}), **override}
    return values


def test_trainer_pods_reach_each_other_on_every_port() -> None:
    trainer = policies(example("values-4nodes.yaml"))["trainer"]
    for port in (29400, 50052, 8002, RANDOM_PORT):
        assert admits(trainer, fleet_pod("trainer"), port), port
    assert admits(trainer, fleet_pod("rollout"), 50052)
    assert not admits(trainer, fleet_pod("rollout"), RANDOM_PORT)
    assert not admits(trainer, fleet_pod("trainer", release="other"), RANDOM_PORT)


def test_engines_and_the_trainer_form_one_group_only_with_the_distributed_weight_sync() -> None:
    distributed = policies(example("values-4nodes.yaml", trainer=DISTRIBUTED))
    for target, source in (("trainer", "engine"), ("engine", "trainer"), ("engine", "engine")):
        assert admits(distributed[target], fleet_pod(source), RANDOM_PORT), f"{source} -> {target}"
    assert not admits(distributed["engine"], fleet_pod("router"), RANDOM_PORT)

    disk = policies(example("values-4nodes.yaml"))
    for target, source in (("trainer", "engine"), ("engine", "engine")):
        assert not admits(disk[target], fleet_pod(source), RANDOM_PORT), f"{source} -> {target}"
    assert not admits(disk["trainer"], fleet_pod("engine"), 8002)
    assert admits(disk["engine"], fleet_pod("trainer"), 30000), "the trainer still reads engines' HTTP API"
    assert not admits(disk["engine"], fleet_pod("trainer"), RANDOM_PORT)


@pytest.mark.parametrize("values_name", [None, "values-4nodes.yaml"], ids=["apiFrom empty", "apiFrom set"])
def test_api_from_never_shuts_out_the_release_nor_the_scrapes(values_name: str | None) -> None:
    rendered = policies(example(values_name) if values_name else {})
    scraper = Source("monitoring", {"app.kubernetes.io/name": "prometheus"})
    for component, port in METRICS_PORTS.items():
        assert admits(rendered[component], scraper, port), f"Prometheus cannot scrape {component}"
    rollout = rendered["rollout"]
    for port in (8000, 50051):
        assert admits(rollout, fleet_pod("trainer"), port), port
        assert admits(rollout, Source("ml-users"), port), port


def test_api_from_narrows_the_runs_api_to_the_listed_sources() -> None:
    rollout = policies(example("values-4nodes.yaml"))["rollout"]
    for stranger in (Source("default"), fleet_pod("trainer", release="other")):
        for port in (8000, 50051):
            assert not admits(rollout, stranger, port), (stranger, port)
    assert not admits(rollout, Source("monitoring"), 50051), "scrapes reach the metrics port only"


def test_metrics_from_given_replaces_the_default_whole() -> None:
    """A selector of the user's own was merged into the default one (Helm merges maps), so its scrapes stayed shut
    out unless they also came from a namespace named monitoring."""
    own = {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]}}
    rendered = policies(own)
    scraper = Source("obs", {"app.kubernetes.io/name": "prometheus"}, {"team": "observability"})
    for component, port in METRICS_PORTS.items():
        assert admits(rendered[component], scraper, port), f"their Prometheus cannot scrape {component}"
        if component != "rollout":  # apiFrom [] (the default) admits every source to the Runs API's port
            default = Source("monitoring", {"app.kubernetes.io/name": "prometheus"})
            assert not admits(rendered[component], default, port), f"the default still in: {component}"

    every = policies({"networkPolicy": {"metricsFrom": []}})
    for component, port in METRICS_PORTS.items():
        assert admits(every[component], Source("anywhere"), port), component
    assert not admits(every["trainer"], Source("anywhere"), 50052), "the metrics port only"


def test_only_the_monitoring_namespaces_prometheus_pods_reach_the_metrics_ports_by_default() -> None:
    """The metrics port is the API port: every pod of the monitoring namespace (Grafana, an exporter, anyone's
    debugging pod) could load weights into an engine or run code through the reward hub."""
    rendered = policies({})
    neighbour = Source("monitoring", {"app.kubernetes.io/name": "grafana"})
    for component, port in METRICS_PORTS.items():
        if component != "rollout":  # apiFrom [] (the default) admits every source to the Runs API's port
            assert not admits(rendered[component], neighbour, port), component
        assert admits(rendered[component], Source("monitoring", {"app.kubernetes.io/name": "prometheus"}), port)
    assert not admits(rendered["engine"], Source("elsewhere", {"app.kubernetes.io/name": "prometheus"}), 30000)
