"""What a user installing the chart is told and given, checked against what the chart renders:
the run NOTES tells them to submit works in the pods, the images deploy/README.md builds are the ones
the chart pulls, the token's Secret is where values.yaml says, the CPU example installs on a bare kind
or k3d cluster, Chart.yaml's kubeVersion is one the chart runs on, and the distributed weight sync is
wired to pod 0."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = REPO / "deploy" / "k8s" / "examples"
SERVICES = sorted(path.parent.name for path in (REPO / "services").glob("*/Dockerfile"))


def render(values: dict[str, Any], release: str = "rl") -> dict[str, str]:
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files: dict[str, str] = chart.render(values, name=release, namespace="ml", is_install=True)
    return files


def manifests(files: dict[str, str]) -> list[dict[str, Any]]:
    return [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def example(name: str) -> dict[str, Any]:
    values: dict[str, Any] = helm.values_from_yaml((EXAMPLES / name).read_text())
    return values


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> pod spec of every Deployment, StatefulSet and Job."""
    return {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def rlfleet_images(docs: list[dict[str, Any]], registry: str) -> set[str]:
    return {
        container["image"]
        for spec in pod_specs(docs).values()
        for container in spec["containers"]
        if container["image"].startswith(f"{registry}/")
    }


def test_notes_submit_a_spec_whose_model_the_pods_have() -> None:
    files = render({})
    notes = files["rlfleet/templates/NOTES.txt"]
    submitted = re.search(r"rlfleet submit (\S+)", notes)
    assert submitted, notes
    spec = yaml.safe_load((REPO / submitted.group(1)).read_text())
    model_path = spec["model"]["path"]
    init = pod_specs(manifests(files))["model-init"]["containers"][0]
    assert f"--out {model_path}" in " ".join(init["args"]), "the model-init Job does not write the spec's model"
    specs = pod_specs(manifests(files))
    for component in ("trainer", "rollout"):  # the trainer loads the model, the orchestrator its tokenizer
        mounts = [m["mountPath"] for m in specs[component]["containers"][0]["volumeMounts"] if m["name"] == "data"]
        assert mounts and model_path.startswith(mounts[0] + "/"), (component, mounts)


def test_notes_without_model_init_name_the_model_the_engines_serve() -> None:
    values = example("values-1node-8gpu.yaml")
    notes = render(values)["rlfleet/templates/NOTES.txt"]
    submit = notes.split("rlfleet submit", 1)[1].split("API token:", 1)[0]
    assert values["engine"]["modelPath"] in submit, notes


def test_the_images_the_readme_builds_are_the_ones_the_chart_pulls() -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    assignment = re.search(r"^REGISTRY=(\S+) TAG=(\S+)$", readme, re.MULTILINE)
    loop = re.search(r"^for svc in ([\w ]+); do$", readme, re.MULTILINE)
    assert assignment and loop, "deploy/README.md no longer shows how to build and tag the images"
    registry, tag = assignment.groups()
    assert sorted(loop.group(1).split()) == SERVICES
    built = set()
    for name in re.findall(r"-t (\S+) \.", readme):
        for svc in SERVICES if "$svc" in name else [""]:
            built.add(name.replace("$REGISTRY", registry).replace("$TAG", tag).replace("$svc", svc))
    for values in ({}, example("values-1node-8gpu.yaml")):  # CPU, then GPU trainer nodes
        pulled = rlfleet_images(manifests(render({**values, "image": {"registry": registry, "tag": tag}})), registry)
        assert pulled and pulled <= built, f"the chart pulls {sorted(pulled - built)}, which the README never builds"
    # The defaults it names are the chart's.
    for values, named in (({}, "docker.io/rlfleet/trainer:0.1.0"), (example("values-1node-8gpu.yaml"), "-cu128")):
        trainer_image = pod_specs(manifests(render(values)))["trainer"]["containers"][0]["image"]
        assert trainer_image.endswith(named) and trainer_image in readme.replace("<svc>", "trainer"), trainer_image


def test_compose_builds_the_images_the_chart_pulls_by_default() -> None:
    compose = yaml.safe_load((REPO / "deploy" / "compose" / "docker-compose.yml").read_text())
    built = {f"docker.io/{s['image']}" for s in compose["services"].values() if "build" in s}
    pulled = rlfleet_images(manifests(render(example("values-cpu.yaml"))), "docker.io/rlfleet")
    assert pulled and pulled <= built, sorted(pulled - built)


def test_values_names_the_token_secret_helm_install_rlfleet_makes() -> None:
    comment = re.search(r"kubectl get secret (\S+) ", (CHART / "values.yaml").read_text())
    assert comment, "values.yaml no longer says how to read the API token"
    secrets = [doc["metadata"]["name"] for doc in manifests(render({}, release="rlfleet")) if doc["kind"] == "Secret"]
    assert secrets == [comment.group(1)]


def test_the_cpu_example_needs_no_prometheus_operator() -> None:
    docs = manifests(render(example("values-cpu.yaml")))
    assert [doc["kind"] for doc in docs if doc["apiVersion"].startswith("monitoring.coreos.com/")] == []


def test_kube_version_admits_no_kubernetes_without_the_pod_index_label() -> None:
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    lower = re.fullmatch(r">=\s*(\d+)\.(\d+)\.\d+(-0)?", constraint)
    assert lower, f"kubeVersion {constraint!r}: expected a lower bound such as >=1.28.0-0"
    assert (int(lower.group(1)), int(lower.group(2))) >= (1, 28), "apps.kubernetes.io/pod-index came in 1.28"
    trainer = render(example("values-4nodes.yaml"))["rlfleet/templates/trainer.yaml"]
    assert "apps.kubernetes.io/pod-index" in trainer
    docs = [REPO / "deploy" / "README.md", *(REPO / "docs").glob("*.md"), CHART / "values.yaml"]
    for path in docs:
        assert not re.search(r"Kubernetes 1\.2[0-7]\b", path.read_text()), path


def trainer_env(values: dict[str, Any]) -> tuple[list[tuple[str, str | None]], str]:
    """The trainer container's environment (name, value) in order, and its StatefulSet's headless Service."""
    [trainer] = [
        d for d in manifests(render(values)) if d["kind"] == "StatefulSet" and "trainer" in d["metadata"]["name"]
    ]
    env = trainer["spec"]["template"]["spec"]["containers"][0]["env"]
    return [(e["name"], e.get("value")) for e in env], trainer["spec"]["serviceName"]


def test_the_distributed_weight_sync_points_the_engines_at_pod_0() -> None:
    values = example("values-4nodes.yaml")
    values["trainer"]["env"] = {"RLFLEET_TRAINER_WEIGHT_SYNC": "distributed"}
    env, ranks = trainer_env(values)
    assert dict(env)["RLFLEET_TRAINER_WEIGHT_SYNC_ADDRESS"] == f"rl-rlfleet-trainer-0.{ranks}"

    values["trainer"]["env"]["RLFLEET_TRAINER_WEIGHT_SYNC_ADDRESS"] = "10.0.0.5"
    env, _ = trainer_env(values)
    assert [value for name, value in env if name == "RLFLEET_TRAINER_WEIGHT_SYNC_ADDRESS"] == ["10.0.0.5"]
    env, _ = trainer_env(example("values-4nodes.yaml"))  # the disk sync needs no address
    assert "RLFLEET_TRAINER_WEIGHT_SYNC_ADDRESS" not in dict(env)
