"""deploy/compose/docker-restarter.yml, the opt-in override that lets the router restart engine containers through
the Docker socket: valid Compose, the router's settings as it reads them with the base file, a socket it can open
(mounted where its docker_url points, in the socket's group, as the router runs as uid 10001), and a default fleet
(docker-compose.yml alone) that configures no restarter and mounts no socket."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet_router.config import RouterConfig


@pytest.fixture(scope="module")
def compose_dir(repo: Path) -> Path:
    return repo / "deploy" / "compose"


@pytest.fixture(scope="module")
def override(compose_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((compose_dir / "docker-restarter.yml").read_text())


def router_env(*files: dict[str, Any]) -> dict[str, str]:
    """The router's variables as Compose merges them (by name, later files win), ${NAME:-default} defaults taken."""
    env: dict[str, str] = {}
    for compose in files:
        for key, value in (compose["services"]["router"].get("environment") or {}).items():
            env[key] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
    return env


def test_the_override_follows_the_compose_specification(compose_dir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(compose_dir / "docker-restarter.yml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_router_restarts_engines_through_a_socket_it_can_open(
    override: dict[str, Any], compose_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert set(override["services"]) == {"router"}, "the override changes the router only"
    base = yaml.safe_load((compose_dir / "docker-compose.yml").read_text())
    env = router_env(base, override)
    for key in [k for k in os.environ if k.startswith("RLFLEET_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = RouterConfig()  # type: ignore[call-arg]
    assert config.restarter == "docker"
    # Every engine URL's host is a Compose service (profile cpu) or a network alias (profile gpu), which the
    # restarter resolves to the container.
    assert config.docker_container == "{host}"
    assert config.docker_url.startswith("unix://")
    router = override["services"]["router"]
    socket = config.docker_url.removeprefix("unix://")
    assert f"/var/run/docker.sock:{socket}" in router["volumes"]
    # The socket is root:docker 0660 and the router runs as uid 10001: it joins the socket's group, which differs
    # between hosts and so comes from the environment, required.
    [group] = router["group_add"]
    assert re.fullmatch(r"\$\{DOCKER_GID:\?[^}]+\}", str(group)), group
    # A restarted engine loads its model before it answers a probe: the SGLang engines' start period, as the chart's
    # restart timeout covers its engines' startup probe budget.
    start = max(
        int(base["services"][name]["healthcheck"]["start_period"].removesuffix("s"))
        for name in ("engine-0", "engine-1", "engine-gpu-0", "engine-gpu-1")
    )
    assert config.restart_timeout_secs > start


def test_the_default_fleet_configures_no_restarter_and_mounts_no_socket(compose_dir: Path) -> None:
    base = yaml.safe_load((compose_dir / "docker-compose.yml").read_text())
    assert "RLFLEET_ROUTER_RESTARTER" not in router_env(base)
    assert not [v for s in base["services"].values() for v in s.get("volumes") or [] if "docker.sock" in v]
    text = (compose_dir / "docker-compose.yml").read_text()
    readme = (compose_dir.parent / "README.md").read_text()
    enable = "docker compose -f docker-compose.yml -f docker-restarter.yml up"
    assert enable in text and enable in readme, "docker-compose.yml and deploy/README.md show how to opt in"
