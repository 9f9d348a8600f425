"""The committed generated code is exactly what scripts/gen_protos.py makes from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    generated = load_generator().generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in generated}
    committed = {p.name: p.read_bytes() for p in (ROOT / "rlfleet" / "v1").glob("*_pb2*.py*")}
    assert set(fresh) == set(committed), "generated file set differs: run scripts/gen_protos.py"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"{stale} differ from their .proto: run .venv/bin/python scripts/gen_protos.py"


def test_every_contract_has_python_code() -> None:
    protos = {p.stem for p in (ROOT / "proto" / "rlfleet" / "v1").glob("*.proto")}
    assert protos == {"samples", "runs", "trainer", "reward"}
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (ROOT / "rlfleet" / "v1" / f"{stem}{suffix}").exists()
