"""The chart sizes what each service may use by what its pod is given: torch's threads by the CPU request,
SGLang engines by their GPUs, and the weight sync's backend by where the trainer and the engines run. A
combination that cannot work is refused at render, saying how to fix it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = sorted((REPO / "deploy" / "k8s" / "examples").glob("*.yaml"))
CASES = [None, *EXAMPLES]
IDS = ["defaults", *(path.stem for path in EXAMPLES)]
DISTRIBUTED = {"RLFLEET_TRAINER_WEIGHT_SYNC": "distributed"}
SGLANG = {"backend": "sglang", "gpus": 1}


def values_of(values_file: Path | None) -> dict[str, Any]:
    return helm.values_from_yaml(values_file.read_text()) if values_file else {}


def render_pods(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """component -> its pod spec, as the chart renders it for `values`."""
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="rl", namespace="ml", is_install=True)
    docs = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    return {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
    }


def render(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """component -> its first container."""
    return {component: spec["containers"][0] for component, spec in render_pods(values).items()}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var["value"] for var in container.get("env", []) if "value" in var}


def cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text.removesuffix("m")) / 1000 if text.endswith("m") else float(text)


def merged(values: dict[str, Any]) -> dict[str, Any]:
    """The chart's defaults under `values`, as the templates see them."""
    base = yaml.safe_load((CHART / "values.yaml").read_text())

    def merge(into: dict[str, Any], override: dict[str, Any]) -> None:
        for key, value in override.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    merge(base, values)
    return base


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_torch_threads_match_the_cpu_request(values_file: Path | None) -> None:
    """The trainer read its own default of 2 threads on the default request of 1 CPU: ranks fought over cores the pod
    was not given. Each rank gets one thread per whole CPU of its share, at least one."""
    values = merged(values_of(values_file))
    rendered = render(values_of(values_file))
    trainer = values["trainer"]
    expected = max(1, int(cpus(trainer["resources"]["requests"]["cpu"]) // trainer["procsPerNode"]))
    assert env_of(rendered["trainer"])["RLFLEET_TRAINER_TORCH_THREADS"] == str(expected)
    if values["engine"]["backend"] == "cpu":
        expected = max(1, int(cpus(values["engine"]["resources"]["requests"]["cpu"])))
        assert env_of(rendered["engine"])["RLFLEET_ENGINE_TORCH_THREADS"] == str(expected)


def test_torch_threads_split_the_request_between_ranks_and_yield_to_env() -> None:
    def threads(trainer: dict[str, Any]) -> str | None:
        return env_of(render({"trainer": trainer})["trainer"]).get("RLFLEET_TRAINER_TORCH_THREADS")

    assert threads({"resources": {"requests": {"cpu": "500m"}}}) == "1"
    assert threads({"resources": {"requests": {"cpu": 8}}, "procsPerNode": 2}) == "4"
    assert threads({"resources": {"requests": {"cpu": "3.5"}}}) == "3"
    assert threads({"env": {"RLFLEET_TRAINER_TORCH_THREADS": "6"}}) == "6"
    assert threads({"resources": {"requests": {"cpu": None, "memory": "2Gi"}}}) is None  # the trainer's own default
    engine = env_of(render({"engine": {"resources": {"requests": {"cpu": 4}}}})["engine"])
    assert engine["RLFLEET_ENGINE_TORCH_THREADS"] == "4"


def test_sglang_engines_without_the_gpus_their_tensor_parallelism_needs_are_refused() -> None:
    """`--set engine.backend=sglang` alone rendered SGLang pods with no GPU, which fail at start."""
    with pytest.raises(Exception, match="engine.backend is sglang and engine.gpus 0"):
        render({"engine": {"backend": "sglang"}})
    with pytest.raises(Exception, match="engine.sglang.tp is 2 and engine.gpus 1"):
        render({"engine": {**SGLANG, "sglang": {"tp": 2}}})
    engine = render({"engine": {"backend": "sglang", "gpus": 2, "sglang": {"tp": 2}}})["engine"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2 and "--tp-size=2" in engine["args"]


def test_sglang_engines_and_a_gpu_trainer_sync_weights_over_nccl() -> None:
    """The trainer's default, gloo, stages every bucket through host memory on both sides of a GPU to GPU copy."""

    def backend(engine: dict[str, Any], trainer: dict[str, Any]) -> str | None:
        return env_of(render({"engine": engine, "trainer": trainer})["trainer"]).get(
            "RLFLEET_TRAINER_WEIGHT_SYNC_BACKEND"
        )

    gpu_trainer = {"gpusPerNode": 2, "procsPerNode": 2, "env": DISTRIBUTED}
    assert backend(SGLANG, gpu_trainer) == "nccl"
    gloo = {**gpu_trainer, "env": {**DISTRIBUTED, "RLFLEET_TRAINER_WEIGHT_SYNC_BACKEND": "gloo"}}
    assert backend(SGLANG, gloo) == "gloo"
    # gloo otherwise (the trainer's default): SGLang joins it from a CPU trainer; CPU engines join nothing else.
    assert backend(SGLANG, {"env": DISTRIBUTED}) is None
    assert backend({}, {"env": DISTRIBUTED}) is None
    assert backend(SGLANG, {**gpu_trainer, "env": {}}) is None  # the disk sync has no group


def test_an_nccl_group_the_trainer_or_the_engines_cannot_join_is_refused() -> None:
    nccl = {**DISTRIBUTED, "RLFLEET_TRAINER_WEIGHT_SYNC_BACKEND": "nccl"}
    with pytest.raises(Exception, match="nccl and trainer.gpusPerNode is 0"):
        render({"engine": SGLANG, "trainer": {"env": nccl}})
    with pytest.raises(Exception, match="nccl and engine.backend is cpu"):
        render({"trainer": {"gpusPerNode": 1, "env": nccl}})


@pytest.mark.parametrize("values_file", [p for p in EXAMPLES if "cpu" not in p.stem], ids=lambda p: p.stem)
def test_gpu_examples_say_the_cpu_services_need_nodes_of_their_own(values_file: Path) -> None:
    """Engines and trainer ranks tolerate the GPU nodes' taint; the other services do not, and so need CPU nodes."""
    values = values_of(values_file)
    assert values["engine"].get("tolerations") and values["trainer"].get("tolerations")
    untolerated = [
        component
        for component, spec in render_pods(values).items()
        if component not in ("engine", "trainer") and not spec.get("tolerations")
    ]
    assert {"router", "reward", "rollout", "redis"} <= set(untolerated)
    header = "\n".join(line for line in values_file.read_text().splitlines() if line.startswith("#"))
    assert "CPU node" in header, f"{values_file.name} does not say it needs CPU nodes"
    readme = (REPO / "deploy" / "README.md").read_text()
    assert f"`{values_file.name}` needs CPU nodes" in readme or f"`{values_file.name}` a CPU node" in readme
