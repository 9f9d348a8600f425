"""Each package of the repository imports in an environment holding only what it declares.

The development environment installs every package together, so a module one package imports can be there
only because another declared it: httptools, which rlfleet/http_head_limit.py needs through uvicorn, came
only with the router, and every other image (each built with its own package alone) failed at start. Here each
package's modules, and every module its code imports (inside functions too, save imports guarded by `except
ImportError` or under TYPE_CHECKING), are imported by a Python that sees only the distributions the package's
requirements reach: the first-party ones from their pyproject.toml, the rest from their installed metadata.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# The root package is checked with its `model` extra: `rlfleet model` creates the tiny model with torch.
EXTRAS = {"rlfleet": ("model",)}
_GUARDS = {"ImportError", "ModuleNotFoundError"}
_PROBE = """
import importlib, json, sys
missing = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing[name] = str(exc)
print(json.dumps(missing))
"""


def _name(raw: str) -> str:
    return raw.lower().replace("_", "-").replace(".", "-")


def _first_party() -> dict[str, tuple[Path, list[Requirement], str]]:
    """Each first-party distribution: its directory, its requirements, its import package."""
    packages = {}
    for pyproject in [REPO / "pyproject.toml", *sorted(REPO.glob("services/*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text())["project"]
        requirements = [Requirement(raw) for raw in project.get("dependencies", [])]
        for extra in EXTRAS.get(project["name"], ()):
            requirements += [Requirement(raw) for raw in project["optional-dependencies"][extra]]
        package = project["name"].replace("-", "_")
        packages[_name(project["name"])] = (pyproject.parent, requirements, package)
    return packages


FIRST_PARTY = _first_party()


def _reached(dist: str) -> set[str]:
    """The distributions `dist`'s requirements reach (markers of the running Python, no extra but those asked)."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(dist, frozenset())]
    while todo:
        name, extras = todo.pop()
        if _name(name) in seen:
            continue
        seen.add(_name(name))
        if _name(name) in FIRST_PARTY:
            requirements = FIRST_PARTY[_name(name)][1]
        else:
            requirements = [Requirement(raw) for raw in metadata.requires(name) or []]
        for requirement in requirements:
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *extras)):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return seen


def _environment(dists: set[str], root: Path) -> Path:
    """A directory of links to what the installed third-party distributions among `dists` hold."""
    root.mkdir()
    for dist in metadata.distributions():
        if _name(dist.metadata["Name"]) not in dists or _name(dist.metadata["Name"]) in FIRST_PARTY:
            continue
        tops = {Path(str(file)).parts[0] for file in dist.files or () if not str(file).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not top.endswith(".pth") and not (root / top).exists():
                (root / top).symlink_to(source)
    return root


def _guarded(tree: ast.AST) -> set[int]:
    """The nodes under a `try` that handles ImportError, or under `if TYPE_CHECKING:`."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        body: list[ast.stmt] = []
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in _GUARDS for h in node.handlers
        ):
            body = node.body
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body = node.body
        nodes.update(id(inner) for statement in body for inner in ast.walk(statement))
    return nodes


def _modules(directory: Path, package: str) -> list[str]:
    """The package's modules (not `__main__`: it runs the service) and every module its code imports."""
    names = set()
    for path in (directory / package).rglob("*.py"):
        parts = path.relative_to(directory).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts[-1] != "__main__":
            names.add(".".join(parts))
        tree = ast.parse(path.read_text(), str(path))
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return sorted(names)


@pytest.mark.parametrize("dist", sorted(FIRST_PARTY))
def test_a_package_imports_with_only_what_it_declares(dist: str, tmp_path: Path) -> None:
    reached = _reached(dist)
    environment = _environment(reached, tmp_path / "site-packages")
    sources = [str(FIRST_PARTY[name][0]) for name in sorted(reached & FIRST_PARTY.keys())]
    directory, _, package = FIRST_PARTY[dist]
    result = subprocess.run(
        [sys.executable, "-S", "-c", _PROBE, json.dumps(_modules(directory, package))],
        env={"PYTHONPATH": os.pathsep.join([str(environment), *sources]), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    missing = json.loads(result.stdout)
    assert not missing, f"{dist} imports what it does not declare: {missing}"
