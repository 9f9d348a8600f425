"""How the chart's pods stop and its releases upgrade: every long-running pod's grace period covers its own
shutdown (the trainer's checkpoint-on-SIGTERM first), torchrun accepts the chart's arguments and gives its
ranks that time, GPU trainer pods have an in-memory /dev/shm for NCCL, and an upgrade that changes the
model-init Job's pod template (immutable in Kubernetes) replaces the Job instead of failing to patch it."""

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
# Kubernetes' default, which the reward hub and the router keep.
DEFAULT_GRACE_S = 30
# The trainer's rank 0 on SIGTERM (rlfleet_trainer.__main__): gRPC stops with grace=5, then TrainerCore.shutdown
# stops and checkpoints the runs within its timeout.
TRAINER_GRPC_GRACE_S = 5


def values_of(values_file: Path | None) -> dict[str, Any]:
    return helm.values_from_yaml(values_file.read_text()) if values_file else {}


def render(values: dict[str, Any], release: str = "rl") -> list[dict[str, Any]]:
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=release, namespace="ml", is_install=True)
    return [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def pod_spec(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    [spec] = [
        doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
        and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return spec


def shutdown_timeout(args: list[str]) -> int:
    """torchrun's --shutdown-timeout as its own parser reads `args` (every argument must be one it knows)."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    assert parsed.shutdown_timeout is not None, "torchrun would SIGKILL the ranks after its default 30 s"
    return int(parsed.shutdown_timeout)


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_trainer_pods_outlive_the_checkpoint_on_sigterm(values_file: Path | None) -> None:
    spec = pod_spec(render(values_of(values_file)), "trainer")
    grace = spec["terminationGracePeriodSeconds"]
    [container] = spec["containers"]
    assert container["command"] == ["tini", "-s", "--", "python", "-m", "rlfleet_trainer.launcher"]
    torchrun_s = shutdown_timeout(container["args"])
    # How long rank 0 waits for the step in progress and its checkpoint, as the chart sets it.
    env = {var["name"]: var.get("value") for var in container["env"]}
    core_shutdown_s = float(env["RLFLEET_TRAINER_SHUTDOWN_TIMEOUT_S"])
    assert core_shutdown_s >= 30
    # The ranks get the trainer's whole shutdown; torchrun then has the rest of the pod's grace to kill and exit.
    assert TRAINER_GRPC_GRACE_S + core_shutdown_s < torchrun_s < grace
    assert grace - torchrun_s >= 10


def test_a_trainer_grace_period_too_short_to_checkpoint_is_refused() -> None:
    with pytest.raises(Exception, match="terminationGracePeriodSeconds"):
        render({"trainer": {"terminationGracePeriodSeconds": 30}})
    spec = pod_spec(render({"trainer": {"terminationGracePeriodSeconds": 120}}), "trainer")
    assert spec["terminationGracePeriodSeconds"] == 120
    assert shutdown_timeout(spec["containers"][0]["args"]) == 105
    env = {var["name"]: var.get("value") for var in spec["containers"][0]["env"]}
    assert env["RLFLEET_TRAINER_SHUTDOWN_TIMEOUT_S"] == "90"


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_the_orchestrator_and_reward_hub_get_the_time_their_shutdown_takes(values_file: Path | None) -> None:
    from rlfleet_reward.config import RewardSettings
    from rlfleet_rollout.config import RolloutConfig

    docs = render(values_of(values_file))
    rollout = RolloutConfig.model_fields
    # Run queue (a trainer call, then the grace), gRPC (the grace), HTTP (the grace and 5 s): one after another.
    trainer_call, grace = rollout["trainer_call_timeout_s"].default, rollout["shutdown_grace_s"].default
    rollout_s = trainer_call + grace + grace + grace + 5
    assert pod_spec(docs, "rollout").get("terminationGracePeriodSeconds", DEFAULT_GRACE_S) > rollout_s
    # gRPC and HTTP (the grace and 5 s) together, then the worker pool.
    reward_s = RewardSettings.model_fields["shutdown_grace_seconds"].default + 5
    assert pod_spec(docs, "reward").get("terminationGracePeriodSeconds", DEFAULT_GRACE_S) > reward_s


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_gpu_trainer_pods_and_only_they_get_an_in_memory_dev_shm(values_file: Path | None) -> None:
    values = values_of(values_file)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["trainer"]
    gpus = int(values.get("trainer", {}).get("gpusPerNode", defaults["gpusPerNode"]))
    spec = pod_spec(render(values), "trainer")
    mounts = {mount["mountPath"]: mount["name"] for mount in spec["containers"][0]["volumeMounts"]}
    if gpus == 0:
        assert "/dev/shm" not in mounts
        return
    [volume] = [v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": defaults["shmSize"]}


def test_the_trainer_shm_size_is_a_setting() -> None:
    spec = pod_spec(render({"trainer": {"gpusPerNode": 4, "procsPerNode": 4, "shmSize": "4Gi"}}), "trainer")
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in spec["volumes"]


def model_init_job(values: dict[str, Any], release: str = "rl") -> dict[str, Any]:
    [job] = [doc for doc in render(values, release) if doc["kind"] == "Job"]
    return job


def test_an_upgrade_that_changes_the_model_init_pod_replaces_the_job() -> None:
    """Kubernetes refuses any change to a Job's pod template, so the name follows the template: an upgrade that
    changes it deletes the old Job and creates a new one. It is no Helm hook: engines are ready only once the
    model exists, and `helm install --wait` (and Flux, and Argo CD) run post-install hooks only after that."""
    job = model_init_job({})
    assert "helm.sh/hook" not in job["metadata"].get("annotations", {})
    assert model_init_job({})["metadata"]["name"] == job["metadata"]["name"]
    # Metadata outside the pod template (the chart's version label) may change in place.
    assert model_init_job({"modelInit": {"enabled": True}})["metadata"]["name"] == job["metadata"]["name"]
    for changed in ({"image": {"tag": "0.2.0"}}, {"modelInit": {"sftSteps": 10}}):
        other = model_init_job(changed)
        assert other["spec"]["template"] != job["spec"]["template"]
        assert other["metadata"]["name"] != job["metadata"]["name"], changed
    # Pods of a Job carry its name as a label value: at most 63 characters, even for the longest release name.
    assert len(model_init_job({}, release="r" * 53)["metadata"]["name"]) <= 63
