"""The chart's engine containers get the variables their program reads: each CPU engine a sampler seed of its own (its
pod's ordinal, as compose and `rlfleet up` give engine i seed i), and SGLang engines the variables `engine.env` gives
(SGLANG_*, NCCL_*), never an RLFLEET_ENGINE_* one, which SGLang would ignore."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet_engine.config import EngineConfig

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "rlfleet"
EXAMPLES = sorted((REPO / "deploy" / "k8s" / "examples").glob("*.yaml"))
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


def values_of(values_file: Path | None) -> dict[str, Any]:
    return helm.values_from_yaml(values_file.read_text()) if values_file else {}


def engine_set(values: dict[str, Any]) -> dict[str, Any]:
    """The engines' StatefulSet as the chart renders it for `values`."""
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        text = chart.render(values, name="rl", namespace="ml", is_install=True)["rlfleet/templates/engine.yaml"]
    [engines] = [doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "StatefulSet"]
    return engines


def engine_container(values: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = engine_set(values)["spec"]["template"]["spec"]["containers"][0]
    return container


def variables_of_pod(container: dict[str, Any], ordinal: int) -> dict[str, str]:
    """The container's variables in the StatefulSet's pod `ordinal`, as the kubelet fills them in."""
    out = {}
    for var in container.get("env", []):
        if "value" in var:
            out[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX, var
            out[var["name"]] = str(ordinal)
    return out


def sampler_seeds(values: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sampler seed each CPU engine pod starts with, as its settings class reads its variables."""
    engines = engine_set(values)
    container = engines["spec"]["template"]["spec"]["containers"][0]
    seeds = []
    for ordinal in range(engines["spec"]["replicas"]):
        with monkeypatch.context() as env:
            for name in [name for name in os.environ if name.startswith("RLFLEET_")]:
                env.delenv(name)
            for name, value in variables_of_pod(container, ordinal).items():
                env.setenv(name, value)
            seeds.append(EngineConfig().random_seed)  # type: ignore[call-arg]  # model_path from the environment
    return seeds


@pytest.mark.parametrize(
    "values_file", [None, *(p for p in EXAMPLES if "cpu" in p.stem)], ids=lambda p: p.stem if p else "defaults"
)
def test_every_cpu_engine_samples_with_a_seed_of_its_own(
    values_file: Path | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One seed for every engine made them all draw the same random stream, and a restarted engine draw it again."""
    values = values_of(values_file)
    seeds = sampler_seeds(values, monkeypatch)
    assert len(seeds) >= 2 and len(set(seeds)) == len(seeds), seeds
    scaled = {**values, "engine": {**values.get("engine", {}), "replicas": 5}}
    assert sorted(sampler_seeds(scaled, monkeypatch)) == list(range(5))


def test_a_seed_given_in_values_replaces_the_ordinal() -> None:
    env = engine_container({"engine": {"env": {"RLFLEET_ENGINE_RANDOM_SEED": 7}}})["env"]
    assert [var for var in env if var["name"] == "RLFLEET_ENGINE_RANDOM_SEED"] == [
        {"name": "RLFLEET_ENGINE_RANDOM_SEED", "value": "7"}
    ]


def test_the_cpu_engine_runs_one_torch_thread_unless_told_otherwise() -> None:
    """The CPU request is one core; a thread per core of the node would fight over it."""
    assert variables_of_pod(engine_container({}), 0)["RLFLEET_ENGINE_TORCH_THREADS"] == "1"
    changed = engine_container({"engine": {"env": {"RLFLEET_ENGINE_TORCH_THREADS": "4"}}})
    assert variables_of_pod(changed, 0)["RLFLEET_ENGINE_TORCH_THREADS"] == "4"


@pytest.mark.parametrize("values_file", [p for p in EXAMPLES if "cpu" not in p.stem], ids=lambda p: p.stem)
def test_sglang_engines_get_the_variables_values_give_them(values_file: Path) -> None:
    """SGLang's and NCCL's variables (a network interface, a health check bound) had no way into its container."""
    values = values_of(values_file)
    assert values["engine"]["backend"] == "sglang"
    assert not [var for var in engine_container(values).get("env", []) if var["name"].startswith("RLFLEET_")]
    given = {"NCCL_SOCKET_IFNAME": "eth0", "SGLANG_HEALTH_CHECK_TIMEOUT": 60}
    values["engine"]["env"] = given
    container = engine_container(values)
    assert container["image"].startswith("lmsysorg/sglang:")
    assert container["env"] == [{"name": name, "value": str(value)} for name, value in sorted(given.items())]


def test_an_rlfleet_engine_variable_for_sglang_is_refused() -> None:
    """SGLang reads no RLFLEET_ENGINE_* variable: one in engine.env would change nothing there."""
    with pytest.raises(Exception, match="engine.env sets RLFLEET_ENGINE_MAX_RUNNING_REQUESTS, which SGLang"):
        engine_set({"engine": {"backend": "sglang", "env": {"RLFLEET_ENGINE_MAX_RUNNING_REQUESTS": "64"}}})
