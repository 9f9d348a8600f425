"""deploy/k8s/rlfleet: Helm lints and renders the chart with its defaults and every example values file,
every manifest validates against the Kubernetes 1.30 schemas (strict: no unknown keys), and the wiring
between components holds."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from rlfleet_router.kubernetes_discovery import endpoint_slice_urls

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")

KUBE_VERSION = "1.30.0"
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = sorted((REPO / "deploy" / "k8s" / "examples").glob("*.yaml"))
CASES = [None, *EXAMPLES]
IDS = ["defaults", *(path.stem for path in EXAMPLES)]


def values_of(values_file: Path | None) -> dict[str, Any]:
    return helm.values_from_yaml(values_file.read_text()) if values_file else {}


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return render(values_of(request.param))


def render(values: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chart's manifests for `values`, and the values the templates saw (the defaults under them)."""
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="rl", namespace="ml", is_install=True)
    docs = [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    # The chart's own defaults under the example's overrides, as templates saw them.
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    _merge(merged, values)
    return merged, docs


def _merge(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
    }


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_helm_lint_is_clean(values_file: Path | None) -> None:
    report = helm.lint(str(CHART), values_of(values_file), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_every_manifest_validates_against_kubernetes(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    checked = 0
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            checked += 1
        except kubernetes_validate.utils.SchemaNotFoundError:
            # Custom resources (ServiceMonitor) have no schema in Kubernetes itself.
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", doc["kind"]
    assert checked >= 20


def test_containers_request_resources_and_rlfleet_images_run_as_non_root(
    rendered: tuple[dict, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    for name, spec in pod_specs(docs).items():
        for container in spec["containers"]:
            assert container["resources"]["requests"], f"{name}/{container['name']} requests nothing"
            if "/rlfleet/" in container["image"]:
                assert spec["securityContext"]["runAsNonRoot"] is True, name
                assert container["securityContext"]["allowPrivilegeEscalation"] is False, name


def test_environment_is_what_the_services_read(
    rendered: tuple[dict, list[dict[str, Any]]], settings_classes: dict[str, type[BaseSettings]]
) -> None:
    _, docs = rendered
    for name, spec in pod_specs(docs).items():
        for container in spec["containers"]:
            for var in container.get("env", []):
                if var["name"].startswith("PET_"):  # torchrun's own options
                    continue
                svc = var["name"].split("_")[1].lower()
                assert svc in settings_classes, f"{name}: {var['name']} names no service"
                field = var["name"].removeprefix(f"RLFLEET_{svc.upper()}_").lower()
                assert field in settings_classes[svc].model_fields, f"{name}: rlfleet_{svc} does not read {var['name']}"


def test_each_service_accepts_the_settings_the_chart_gives_it(
    rendered: tuple[dict, list[dict[str, Any]]],
    settings_classes: dict[str, type[BaseSettings]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The variables' values, not only their names: each rlfleet container's settings class builds from exactly the
    variables the chart gives it (a value it refuses stops the service at start)."""
    _, docs = rendered
    built = []
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        [container] = doc["spec"]["template"]["spec"]["containers"]
        if component not in settings_classes or "/rlfleet/" not in container["image"]:
            continue  # Redis, SGLang
        with monkeypatch.context() as env:
            for name in [name for name in os.environ if name.startswith("RLFLEET_")]:
                env.delenv(name)
            for var in container.get("env", []):
                if "value" in var:
                    env.setenv(var["name"], var["value"])
                else:  # the pod's ordinal
                    assert var["valueFrom"]["fieldRef"]["fieldPath"].endswith("['apps.kubernetes.io/pod-index']"), var
                    env.setenv(var["name"], "1")
            try:
                settings_classes[component]()
            except ValueError as exc:
                pytest.fail(f"{doc['metadata']['name']}: rlfleet_{component} refuses the chart's settings: {exc}")
        built.append(component)
    assert {"router", "reward", "rollout", "trainer"} <= set(built)


def test_router_lists_every_engine_and_services_find_each_other(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    values, docs = rendered
    specs = pod_specs(docs)
    env = {
        var["name"]: var["value"]
        for spec in specs.values()
        for c in spec["containers"]
        for var in c.get("env", [])
        if "value" in var
    }
    engines = by_kind(docs, "StatefulSet")["rl-rlfleet-engine"]
    replicas, port = values["engine"]["replicas"], values["engine"]["port"]
    assert engines["spec"]["replicas"] == replicas
    services = by_kind(docs, "Service")
    headless = services[engines["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    if values["router"]["kubernetes"]["discovery"]:
        # The router finds them in the headless Service's EndpointSlices, which carry the Service's labels (the
        # router's selector) and name it; each pod's endpoint carries its hostname (the pod's name), ready or not
        # (publishNotReadyAddresses: the router runs its own health checks): the URLs are the pods' DNS names,
        # stable across pod restarts.
        assert "RLFLEET_ROUTER_WORKER_URLS" not in env
        assert headless["spec"]["publishNotReadyAddresses"] is True
        selector = dict(part.split("=", 1) for part in env["RLFLEET_ROUTER_KUBERNETES_LABEL_SELECTOR"].split(","))
        labels = {**headless["metadata"]["labels"], "kubernetes.io/service-name": headless["metadata"]["name"]}
        assert selector.items() <= labels.items()
        slices = [
            {
                "metadata": {"name": f"{headless['metadata']['name']}-x7k2q", "labels": labels},
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": [f"10.0.0.{i}"],
                        "conditions": {"ready": True, "serving": i > 0, "terminating": False},
                        "hostname": f"rl-rlfleet-engine-{i}",
                    }
                    for i in range(replicas)
                ],
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            }
        ]
        urls = sorted(endpoint_slice_urls(slices, int(env["RLFLEET_ROUTER_KUBERNETES_ENGINE_PORT"]), "ml")[0])
    else:
        urls = json.loads(env["RLFLEET_ROUTER_WORKER_URLS"])
    assert urls == [f"http://rl-rlfleet-engine-{i}.rl-rlfleet-engine.ml.svc:{port}" for i in range(replicas)]
    for key in ("RLFLEET_ROLLOUT_ROUTER_URL", "RLFLEET_ROLLOUT_REWARD_URL", "RLFLEET_TRAINER_ROUTER_URL"):
        url = env[key]
        host, port = url.removeprefix("http://").split(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], url
    host, port = env["RLFLEET_ROLLOUT_TRAINER_ADDRESS"].split(":")
    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]


def test_no_pod_gets_the_services_variables(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    """Kubernetes would give each pod variables named after every Service, e.g. RLFLEET_ROUTER_PORT=tcp://...
    for Service rlfleet-router (`helm install rlfleet`), which the router would read as its port setting."""
    _, docs = rendered
    specs = pod_specs(docs)
    assert specs and all(spec.get("enableServiceLinks") is False for spec in specs.values()), [
        name for name, spec in specs.items() if spec.get("enableServiceLinks") is not False
    ]


def test_the_router_follows_prefix_caches_only_where_engines_keep_them(
    rendered: tuple[dict, list[dict[str, Any]]],
) -> None:
    values, docs = rendered
    [router] = [spec for name, spec in pod_specs(docs).items() if name.endswith("router")]
    env = {var["name"]: var["value"] for var in router["containers"][0].get("env", [])}
    # SGLang engines keep a prefix cache to follow; rlfleet's CPU engine keeps none.
    default = "cache_aware" if values["engine"]["backend"] == "sglang" else "least_load"
    assert env["RLFLEET_ROUTER_POLICY"] == (values["router"]["policy"] or default)


def test_trainer_rank_0_is_on_the_pod_the_trainer_service_selects(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    values, docs = rendered
    trainer = by_kind(docs, "StatefulSet")["rl-rlfleet-trainer"]
    args = trainer["spec"]["template"]["spec"]["containers"][0]["args"]
    nodes = values["trainer"]["nodes"]
    assert trainer["spec"]["replicas"] == nodes and f"--nnodes={nodes}" in args
    assert args[-3:] == ["-m", "rlfleet_trainer", "serve"]
    services = by_kind(docs, "Service")
    assert services["rl-rlfleet-trainer"]["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == (
        "rl-rlfleet-trainer-0"
    )
    if nodes > 1:
        # Static rendezvous with the pod ordinal as node rank: pod 0 hosts the store and runs rank 0.
        assert "--rdzv-backend=static" in args
        master = next(a for a in args if a.startswith("--master-addr=")).split("=")[1]
        assert master == f"rl-rlfleet-trainer-0.{trainer['spec']['serviceName']}"
        env = {e["name"]: e for e in trainer["spec"]["template"]["spec"]["containers"][0]["env"]}
        field = env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
        assert services[trainer["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    gpus = values["trainer"]["gpusPerNode"]
    limits = trainer["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu", 0) == gpus


def test_a_trainer_pod_runs_one_rank_per_gpu() -> None:
    """Each rank takes the GPU of its local rank: with the default one rank, `gpusPerNode: 8` trained on one GPU of the
    eight, and more ranks than GPUs ask for a device that does not exist."""
    for procs in (1, 2, 16):
        with pytest.raises(Exception, match=f"trainer.procsPerNode is {procs} and trainer.gpusPerNode 8"):
            render({"trainer": {"gpusPerNode": 8, "procsPerNode": procs}})
    _, docs = render({"trainer": {"gpusPerNode": 8, "procsPerNode": 8}})
    args = by_kind(docs, "StatefulSet")["rl-rlfleet-trainer"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--nproc_per_node=8" in args
    _, docs = render({"trainer": {"gpusPerNode": 0, "procsPerNode": 4}})  # CPU ranks: as many as asked
    args = by_kind(docs, "StatefulSet")["rl-rlfleet-trainer"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--nproc_per_node=4" in args


def test_generations_in_flight_keep_gpu_engines_busy(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    """The orchestrator's own 8 groups in flight fit the CPU engine; on SGLang they left GPUs idle between a step's
    groups (with 6 engines, about 10 sequences each of the hundreds they run at once)."""
    values, docs = rendered
    [rollout] = [spec for name, spec in pod_specs(docs).items() if name.endswith("-rollout")]
    env = {var["name"]: var.get("value") for var in rollout["containers"][0]["env"]}
    wanted = 32 * values["engine"]["replicas"] if values["engine"]["backend"] == "sglang" else None
    assert env.get("RLFLEET_ROLLOUT_MAX_CONCURRENT_GENERATIONS") == (None if wanted is None else str(wanted))
    _, chosen = render({"engine": {"backend": "sglang", "gpus": 1}, "rollout": {"maxConcurrentGenerations": 100}})
    [rollout] = [spec for name, spec in pod_specs(chosen).items() if name.endswith("-rollout")]
    assert {"name": "RLFLEET_ROLLOUT_MAX_CONCURRENT_GENERATIONS", "value": "100"} in rollout["containers"][0]["env"]


def test_dashboards_ship_as_configmaps_for_the_grafana_sidecar(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    maps = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["labels"].get("grafana_dashboard")]
    shipped = {key: json.loads(text) for doc in maps for key, text in doc["data"].items()}
    sources = {path.name: json.loads(path.read_text()) for path in (REPO / "deploy" / "grafana").glob("*.json")}
    assert shipped == sources and len(sources) == 4


def test_redis_appends_to_a_persistent_volume_unless_external(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    values, docs = rendered
    redis = by_kind(docs, "StatefulSet").get("rl-rlfleet-redis")
    if values["redis"]["external"]["url"]:
        assert redis is None
        return
    assert redis is not None
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory") + 1] == values["redis"]["maxmemory"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"  # run data is never evicted
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "redis-data"


def test_engines_read_the_shared_volume_and_cannot_change_it(rendered: tuple[dict, list[dict[str, Any]]]) -> None:
    """It holds the trainer's checkpoints, whose metadata is a pickle the trainer loads: an engine that could write
    there could change what the trainer resumes from. Engines only read models and weight versions."""
    _, docs = rendered
    engine = by_kind(docs, "StatefulSet")["rl-rlfleet-engine"]["spec"]["template"]["spec"]["containers"][0]
    data = next(m for m in engine["volumeMounts"] if m["name"] == "data")
    assert data["mountPath"] == "/data" and data["readOnly"] is True


def test_checkpoint_volume_is_shared_read_write_many_by_default() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render({}, name="rl", namespace="ml", is_install=True)
    claim = yaml.safe_load(files["rlfleet/templates/data-pvc.yaml"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize(("discovery", "restarts"), [(False, False), (False, True), (True, False)])
def test_router_without_some_kubernetes_api_use(discovery: bool, restarts: bool) -> None:
    """The router's engine list and Role follow each use of the Kubernetes API being turned off."""
    rendered = render({"router": {"kubernetes": {"discovery": discovery, "restarts": restarts}}})
    test_router_lists_every_engine_and_services_find_each_other(rendered)
    test_router_discovers_and_restarts_engines_through_the_api_it_may_use(rendered)


def test_router_discovers_and_restarts_engines_through_the_api_it_may_use(
    rendered: tuple[dict, list[dict[str, Any]]],
) -> None:
    values, docs = rendered
    [router] = [spec for name, spec in pod_specs(docs).items() if name.endswith("router")]
    env = {var["name"]: var["value"] for var in router["containers"][0].get("env", [])}
    kube = values["router"]["kubernetes"]
    assert (env.get("RLFLEET_ROUTER_KUBERNETES_DISCOVERY") == "true") == kube["discovery"]
    assert (env.get("RLFLEET_ROUTER_RESTARTER") == "kubernetes") == kube["restarts"]
    roles = by_kind(docs, "Role")
    if kube["discovery"] or kube["restarts"]:
        assert "app.kubernetes.io/component=engine" in env["RLFLEET_ROUTER_KUBERNETES_LABEL_SELECTOR"]
        [role] = [r for name, r in roles.items() if name.endswith("router")]
        granted = {
            (group, res, verb)
            for r in role["rules"]
            for group in r["apiGroups"]
            for res in r["resources"]
            for verb in r["verbs"]
        }
        # Exactly what rlfleet_router.kubernetes_api calls: discovery lists EndpointSlices; restarts list and delete
        # pods. Nothing reads the deprecated core/v1 Endpoints.
        wanted = {("discovery.k8s.io", "endpointslices", "list")} if kube["discovery"] else set()
        wanted |= {("", "pods", "list"), ("", "pods", "delete")} if kube["restarts"] else set()
        assert granted == wanted
        engine_labels = [
            doc["metadata"]["labels"]
            for doc in docs
            if doc["kind"] == "Service" and doc["metadata"]["name"].endswith("engine")
        ]
        assert engine_labels and all(labels["app.kubernetes.io/component"] == "engine" for labels in engine_labels)
    else:
        assert not [name for name in roles if name.endswith("router")]
    if kube["restarts"]:
        # A recreated engine has its startup probe's whole budget to load the model before its restart fails.
        startup = values["engine"]["probes"]["startup"]
        assert (
            float(env["RLFLEET_ROUTER_RESTART_TIMEOUT_SECS"]) > startup["periodSeconds"] * startup["failureThreshold"]
        )


def test_each_service_monitor_scrapes_every_pod_of_its_component_once(
    rendered: tuple[dict, list[dict[str, Any]]],
) -> None:
    """Every trainer node's first rank serves /metrics (its rank ops); the trainer's Service selects pod 0
    only, so the trainer is scraped through its headless Service, and pod 0 not a second time."""
    values, docs = rendered
    monitors = by_kind(docs, "ServiceMonitor")
    if not values["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    services = list(by_kind(docs, "Service").values())
    for monitor in monitors.values():
        [endpoint] = monitor["spec"]["endpoints"]
        wanted = monitor["spec"]["selector"]["matchLabels"]
        matched = [
            s
            for s in services
            if wanted.items() <= s["metadata"]["labels"].items()
            and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])
        ]
        assert len(matched) == 1, (monitor["metadata"]["name"], [s["metadata"]["name"] for s in matched])
        selector = matched[0]["spec"]["selector"]
        assert "statefulset.kubernetes.io/pod-name" not in selector, monitor["metadata"]["name"]
