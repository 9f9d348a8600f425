"""services/<svc>/Dockerfile, parsed with Docker's own parser (building needs a Docker engine): multi-stage,
pinned bases, a non-root user, no torch in the slim images, an entrypoint module that starts, and an init
process as PID 1 where the service starts subprocesses."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

dockerfile = pytest.importorskip("dockerfile", reason="needs the dockerfile package (the dev extra)")

REPO = Path(__file__).resolve().parents[2]
SERVICES = ["engine", "reward", "rollout", "router", "trainer"]
SLIM = ["reward", "rollout", "router"]
# A tag with a full X.Y.Z version (and optionally a variant), or a digest: never "latest" or a floating major.
PINNED = re.compile(r"^[\w./-]+(:\d+\.\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$")
HEAVY = {"torch", "transformers", "nvidia-cuda-runtime-cu12", "triton"}
# Services whose processes start others that can outlive them: the reward hub's scorer workers (their
# sandboxed children), torchrun's ranks. PID 1 inherits the orphans and must reap them.
SPAWNING = ["reward", "trainer"]


def instructions(svc: str) -> list:
    return list(dockerfile.parse_file(str(REPO / "services" / svc / "Dockerfile")))


def final_stage(svc: str) -> list:
    parsed = instructions(svc)
    last_from = max(i for i, ins in enumerate(parsed) if ins.cmd == "FROM")
    return parsed[last_from:]


@pytest.mark.parametrize("svc", SERVICES)
def test_multi_stage_from_pinned_bases(svc: str) -> None:
    bases = [ins.value[0] for ins in instructions(svc) if ins.cmd == "FROM"]
    assert len(bases) >= 2, "build and runtime stages"
    for base in bases:
        assert PINNED.match(base) and ("@sha256:" in base or re.search(r":\d+\.\d+\.\d+", base)), base


@pytest.mark.parametrize("svc", SERVICES)
def test_runtime_stage_runs_as_a_non_root_user(svc: str) -> None:
    users = [ins.value[0] for ins in final_stage(svc) if ins.cmd == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")


@pytest.mark.parametrize("svc", SERVICES)
def test_copied_sources_exist(svc: str) -> None:
    for ins in instructions(svc):
        if ins.cmd == "COPY" and not any(flag.startswith("--from=") for flag in ins.flags):
            for source in ins.value[:-1]:
                assert (REPO / source).exists(), f"{svc}: COPY {source}"


def installed_projects(svc: str) -> list[str]:
    """The local projects the image's pip installs: '.' is the shared library, ./services/x a service."""
    names = []
    for ins in instructions(svc):
        if ins.cmd == "RUN" and "pip install" in ins.value[0]:
            for word in ins.value[0].split():
                word = word.strip('"')
                if word.startswith("."):
                    names.append("rlfleet" if word.split("[")[0] == "." else f"rlfleet-{Path(word).name}")
    return names


def dependency_closure(names: list[str]) -> set[str]:
    """Every distribution the named ones pull in (extras not requested are left out), as installed here."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.mark.parametrize("svc", SLIM)
def test_slim_images_install_no_torch(svc: str) -> None:
    runs = " ".join(ins.value[0] for ins in instructions(svc) if ins.cmd == "RUN")
    assert "torch" not in runs and "[model]" not in runs
    projects = installed_projects(svc)
    assert projects == ["rlfleet", f"rlfleet-{svc}"]
    closure = dependency_closure(projects)
    assert f"rlfleet-{svc}" in closure and not (closure & HEAVY), sorted(closure & HEAVY)


@pytest.mark.parametrize("svc", SERVICES)
def test_entrypoint_module_exists_and_starts(svc: str) -> None:
    command = [word for ins in final_stage(svc) if ins.cmd in ("ENTRYPOINT", "CMD") for word in ins.value]
    modules = [command[i + 1] for i, word in enumerate(command) if word == "-m"]
    assert all(importlib.util.find_spec(m) is not None for m in modules), modules
    module = modules[-1]  # the trainer's launcher (torchrun) runs the service module after its own options
    assert module == f"rlfleet_{svc}"
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_build_context_leaves_out_the_local_environment() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"**/.venv", "**/.git", ".rlfleet"} <= set(ignored)


@pytest.mark.parametrize("svc", SPAWNING)
def test_services_that_start_subprocesses_run_under_tini(svc: str) -> None:
    stage = final_stage(svc)
    [entrypoint] = [list(ins.value) for ins in stage if ins.cmd == "ENTRYPOINT"]
    # -s: tini reaps as a subreaper also when it is not PID 1 (compose's `init: true` puts docker-init there).
    assert entrypoint[:3] == ["tini", "-s", "--"], entrypoint
    installs = [ins.value[0] for ins in stage if ins.cmd == "RUN" and "apt-get install" in ins.value[0]]
    assert any(re.search(r"\btini\b", run) for run in installs), "the runtime stage does not install tini"
    # apt's lists stay out of the image.
    assert all("rm -rf /var/lib/apt/lists/*" in run for run in installs)


@pytest.mark.parametrize("svc", SERVICES)
def test_images_listen_on_every_interface_through_the_variable(svc: str) -> None:
    """ENV RLFLEET_<SVC>_HOST=0.0.0.0, which a deployment overrides (e.g. `::` for IPv6); a --host flag in the
    entrypoint would beat the variable (flags win)."""
    stage = final_stage(svc)
    env = dict(zip(*[iter(value for ins in stage if ins.cmd == "ENV" for value in ins.value)] * 2, strict=True))
    assert env.get(f"RLFLEET_{svc.upper()}_HOST") == "0.0.0.0"
    command = [word for ins in stage if ins.cmd in ("ENTRYPOINT", "CMD") for word in ins.value]
    assert not [word for word in command if word.split("=")[0] == "--host"], command
