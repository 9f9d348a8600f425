"""deploy/compose: valid against the Compose Specification, every reference resolves, every service's
variables, ports and health checks are the ones the services really read and serve, and long-running services
restart, get the shutdown time they need and reap their children."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

# Compose service -> the rlfleet service it runs.
RLFLEET_SERVICES = {
    "engine-0": "engine",
    "engine-1": "engine",
    "router": "router",
    "reward": "reward",
    "trainer": "trainer",
    "trainer-gpu": "trainer",
    "rollout": "rollout",
}
# Services that do their work and exit: they must not be restarted.
ONE_SHOT = {"api-token", "model-init", "demo"}
HEALTH_URL = re.compile(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)")
# How the gpu profile starts (deploy/README.md, the compose file's header).
GPU_UP = (
    "COMPOSE_PROFILES=gpu RLFLEET_ROUTER_POLICY=cache_aware RLFLEET_ROLLOUT_MAX_CONCURRENT_GENERATIONS=64"
    " docker compose up"
)
# ${NAME:-default}, as Compose interpolates it.
VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")


@pytest.fixture(scope="module")
def compose_dir(repo: Path) -> Path:
    return repo / "deploy" / "compose"


@pytest.fixture(scope="module")
def compose(compose_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((compose_dir / "docker-compose.yml").read_text())


def env_of(service: dict[str, Any], shell: dict[str, str] | None = None) -> dict[str, str]:
    """The service's variables as Compose sets them, ${NAME:-default} taken from `shell` (none set by default)."""
    shell = shell or {}
    return {
        key: VARIABLE.sub(lambda m: shell.get(m.group(1)) or m.group(2), str(value))
        for key, value in (service.get("environment") or {}).items()
    }


def seconds(duration: str) -> float:
    """A Compose duration such as 1m30s or 300s."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"not a duration: {duration!r}"
    hours, minutes, secs = (int(part or 0) for part in parts.groups())
    return hours * 3600 + minutes * 60 + secs


def settings_from(cls: type[BaseSettings], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> BaseSettings:
    """The settings the service process would build from exactly these variables."""
    for key in [k for k in os.environ if k.startswith("RLFLEET_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return cls()  # type: ignore[call-arg]


def health_port_and_path(service: dict[str, Any]) -> tuple[int, str]:
    match = HEALTH_URL.search(" ".join(service["healthcheck"]["test"]))
    assert match, f"health check is not an HTTP probe of 127.0.0.1: {service['healthcheck']['test']}"
    return int(match.group(1)), match.group(2)


def test_compose_file_follows_the_compose_specification(compose_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(compose_dir / "docker-compose.yml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_reference_resolves(compose: dict[str, Any], compose_dir: Path) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep in service.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (compose_dir / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} mounts undeclared volume {source}"
        for kind in ("configs", "secrets"):
            for ref in service.get(kind) or []:
                key = ref["source"] if isinstance(ref, dict) else ref
                assert key in compose[kind], f"{name} uses undeclared {kind[:-1]} {key}"
        build = service.get("build")
        if build:
            assert (compose_dir / build["context"] / build["dockerfile"]).is_file()
    for config in compose["configs"].values():
        assert (compose_dir / config["file"]).is_file()


def test_cpu_is_the_default_profile_and_each_profile_is_a_whole_fleet(
    compose: dict[str, Any], compose_dir: Path
) -> None:
    assert "COMPOSE_PROFILES=cpu" in (compose_dir / ".env").read_text().splitlines()
    for profile in ("cpu", "gpu"):
        active = {n for n, s in compose["services"].items() if "profiles" not in s or profile in s["profiles"]}
        assert {"redis", "router", "reward", "rollout", "prometheus", "grafana", "model-init"} <= active
        hosts = set(active)
        for name in active:
            hosts |= set(compose["services"][name].get("networks", {}).get("default", {}).get("aliases", []))
        assert {"engine-0", "engine-1", "trainer"} <= hosts, f"profile {profile} lacks engines or a trainer"
        for name in active:
            for dep, condition in (compose["services"][name].get("depends_on") or {}).items():
                if condition.get("required", True):
                    assert dep in active, f"{name} needs {dep}, which profile {profile} does not start"


def test_variables_ports_and_health_checks_match_the_services(
    compose: dict[str, Any], settings_classes: dict[str, type[BaseSettings]], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    listening: dict[str, Any] = {}
    for name, kind in RLFLEET_SERVICES.items():
        cls = settings_classes[kind]
        env = env_of(services[name])
        prefix = f"RLFLEET_{kind.upper()}_"
        for key in env:
            assert key.startswith(prefix), f"{name}: {key} is not read by rlfleet_{kind}"
            assert key.removeprefix(prefix).lower() in cls.model_fields, f"{name}: rlfleet_{kind} has no {key}"
        settings: Any = settings_from(cls, env, monkeypatch)  # its own fields are read below
        listening[name] = settings
        http_port = getattr(settings, "http_port", None) or settings.port
        assert health_port_and_path(services[name]) == (http_port, "/health"), name
        for published in services[name].get("ports") or []:
            container_port = int(published.rsplit(":", 1)[1])
            assert container_port in (http_port, getattr(settings, "grpc_port", None)), f"{name}: {published}"

    router, rollout, trainer = listening["router"], listening["rollout"], listening["trainer"]
    assert router.worker_urls == [
        f"http://engine-0:{listening['engine-0'].port}",
        f"http://engine-1:{listening['engine-1'].port}",
    ]
    assert rollout.router_url == trainer.router_url == f"http://router:{router.port}"
    assert rollout.reward_url == f"http://reward:{listening['reward'].port}"
    assert rollout.trainer_address == f"trainer:{trainer.grpc_port}"
    assert rollout.redis_url == trainer.redis_url == "redis://redis:6379/0"
    assert env_of(services["trainer"]) == env_of(services["trainer-gpu"])


def test_gpu_engines_serve_where_the_router_looks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, alias in (("engine-gpu-0", "engine-0"), ("engine-gpu-1", "engine-1")):
        gpu = services[name]
        command = gpu["command"]
        assert command[:3] == ["python3", "-m", "sglang.launch_server"] and "--enable-metrics" in command
        cpu_port = int(env_of(services[alias])["RLFLEET_ENGINE_PORT"])
        assert int(command[command.index("--port") + 1]) == cpu_port
        assert gpu["networks"]["default"]["aliases"] == [alias]
        assert health_port_and_path(gpu) == (cpu_port, "/health")
        assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_the_router_follows_no_prefix_cache_the_cpu_engines_do_not_keep(
    compose: dict[str, Any], compose_dir: Path, repo: Path
) -> None:
    """As the chart and `rlfleet up`: least_load in front of the CPU engines (the default profile), which keep no
    prefix cache; the gpu profile's documented command line exports cache_aware, which follows SGLang's."""
    router = compose["services"]["router"]
    assert env_of(router)["RLFLEET_ROUTER_POLICY"] == "least_load"
    assert env_of(router, {"RLFLEET_ROUTER_POLICY": "cache_aware"})["RLFLEET_ROUTER_POLICY"] == "cache_aware"
    for doc in (compose_dir / "docker-compose.yml", repo / "deploy" / "README.md"):
        assert GPU_UP in doc.read_text(), f"{doc} does not show how to start the gpu profile"


def test_the_gpu_profile_keeps_as_many_generations_in_flight_per_engine_as_the_chart(
    compose: dict[str, Any], settings_classes: dict[str, type[BaseSettings]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator's own 8 fit the CPU engines; the chart gives SGLang engines 32 each, which run hundreds of
    sequences at once (8 left them idle between a step's groups)."""
    services = compose["services"]
    rollout, cls = services["rollout"], settings_classes["rollout"]
    cpu: Any = settings_from(cls, env_of(rollout), monkeypatch)
    assert cpu.max_concurrent_generations == cls.model_fields["max_concurrent_generations"].default
    exported = dict(re.findall(r"(RLFLEET_\w+)=(\S+)", GPU_UP))
    gpu: Any = settings_from(cls, env_of(rollout, exported), monkeypatch)
    sglang_engines = [
        name for name, service in services.items() if "sglang.launch_server" in service.get("command", [])
    ]
    assert len(sglang_engines) == 2
    assert gpu.max_concurrent_generations == 32 * len(sglang_engines)


def run_healthcheck(test: list[str], env: dict[str, str]) -> int:
    """The exit status of a Compose healthcheck's `test`, run as Docker runs it."""
    kind, *command = test
    if kind == "CMD-SHELL":
        command = ["sh", "-c", *command]
    assert kind in ("CMD", "CMD-SHELL"), test
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def test_redis_is_healthy_only_once_it_answers_pong(
    compose: dict[str, Any], redis_cli_at: Callable[[int], dict[str, str]], loading_redis: int, ready_redis: int
) -> None:
    """While Redis loads its AOF it answers LOADING, on which `redis-cli ping` exits 0: the trainer and the
    orchestrator, which wait for Redis to be healthy, started against a Redis that refused their every command."""
    test = compose["services"]["redis"]["healthcheck"]["test"]
    assert run_healthcheck(test, redis_cli_at(loading_redis)) != 0
    assert run_healthcheck(test, redis_cli_at(ready_redis)) == 0


def test_long_running_services_restart_and_one_shot_services_do_not(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name in ONE_SHOT:
            assert service.get("restart", "no") == "no", name
        else:
            assert service.get("restart") == "unless-stopped", name


def test_services_that_start_subprocesses_reap_them(compose: dict[str, Any]) -> None:
    """PID 1 inherits every orphaned process: the reward hub's killed scorer workers leave sandboxed children,
    torchrun's ranks and the engines start processes of their own."""
    for name in ("reward", "trainer", "trainer-gpu", "engine-0", "engine-1", "engine-gpu-0", "engine-gpu-1"):
        assert compose["services"][name].get("init") is True, name


def trainer_image_shutdown(repo: Path) -> tuple[float, int]:
    """The trainer image's RLFLEET_TRAINER_SHUTDOWN_TIMEOUT_S (rank 0's wait for the step in progress and its
    checkpoint) and torchrun's --shutdown-timeout, as torchrun's own parser reads the ENTRYPOINT."""
    dockerfile = pytest.importorskip("dockerfile", reason="needs the dockerfile package (the dev extra)")
    from torch.distributed.run import get_args_parser

    parsed = list(dockerfile.parse_file(str(repo / "services" / "trainer" / "Dockerfile")))
    [entrypoint] = [list(ins.value) for ins in parsed if ins.cmd == "ENTRYPOINT"]
    [command] = [list(ins.value) for ins in parsed if ins.cmd == "CMD"]
    env = dict(zip(*[iter(value for ins in parsed if ins.cmd == "ENV" for value in ins.value)] * 2, strict=True))
    args = get_args_parser().parse_args(entrypoint[entrypoint.index("rlfleet_trainer.launcher") + 1 :] + command)
    assert args.shutdown_timeout is not None, "torchrun would SIGKILL the ranks after its default 30 s"
    return float(env["RLFLEET_TRAINER_SHUTDOWN_TIMEOUT_S"]), int(args.shutdown_timeout)


def test_services_get_the_time_their_shutdown_takes(compose: dict[str, Any], repo: Path) -> None:
    """Docker kills a container 10 s after SIGTERM unless told otherwise."""
    from rlfleet_reward.config import RewardSettings
    from rlfleet_rollout.config import RolloutConfig

    services = compose["services"]

    def grace(name: str) -> float:
        return seconds(services[name].get("stop_grace_period", "10s"))

    # The trainer: gRPC stops (5 s), then its runs stop and checkpoint; torchrun gives its ranks that long.
    core_shutdown_s, torchrun_s = trainer_image_shutdown(repo)
    assert 5 + core_shutdown_s < torchrun_s
    for name in ("trainer", "trainer-gpu"):
        assert grace(name) >= torchrun_s + 10, name
    rollout = RolloutConfig.model_fields
    trainer_call, drain = rollout["trainer_call_timeout_s"].default, rollout["shutdown_grace_s"].default
    assert grace("rollout") > trainer_call + 3 * drain + 5
    assert grace("reward") > RewardSettings.model_fields["shutdown_grace_seconds"].default + 5
    assert grace("router") > 5  # its HTTP server's graceful shutdown


def test_the_gpu_trainer_has_room_in_dev_shm(compose: dict[str, Any]) -> None:
    """NCCL passes data through /dev/shm, 64 MB in a container unless shm_size says more."""
    size = re.fullmatch(r"(\d+)([kmg]?)b?", str(compose["services"]["trainer-gpu"].get("shm_size", "64m")).lower())
    assert size, "shm_size is not a byte size"
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[size.group(2)]
    assert int(size.group(1)) * scale >= 2**30


def test_prometheus_scrapes_every_service_where_it_listens(compose: dict[str, Any], compose_dir: Path) -> None:
    scrape = yaml.safe_load((compose_dir / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape["scrape_configs"]}
    expected: dict[str, list[str]] = {}
    for name, kind in RLFLEET_SERVICES.items():
        if name == "trainer-gpu":
            continue
        port, _ = health_port_and_path(compose["services"][name])
        expected.setdefault(kind, []).append(f"{name}:{port}")
    assert targets == expected


def test_redis_keeps_an_append_only_file_on_a_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    data_dir = command[command.index("--dir") + 1]
    assert any(v.split(":")[1] == data_dir and v.split(":")[0] in compose["volumes"] for v in redis["volumes"])


def test_engines_read_the_shared_volume_and_cannot_change_it(compose: dict[str, Any]) -> None:
    """It holds the trainer's checkpoints, whose metadata is a pickle the trainer loads; engines only read models
    and weight versions."""
    engines = [s for name, s in compose["services"].items() if name.startswith("engine") or "sglang" in name]
    assert engines
    for engine in engines:
        assert [v for v in engine["volumes"] if v.split(":")[1] == "/data"] == ["data:/data:ro"], engine
