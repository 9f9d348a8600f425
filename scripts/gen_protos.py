"""Generates the Python code for proto/rlfleet/v1/*.proto into rlfleet/v1/.

The generated modules (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) are committed and never edited by
hand; `tests/test_proto_drift.py` runs this script into a temporary directory and fails when the
committed files differ. Run it after changing a .proto:

    .venv/bin/python scripts/gen_protos.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every contract, writing `rlfleet/v1/...` below `out_dir`; returns the files."""
    import grpc_tools
    from grpc_tools import protoc  # a dev dependency: only this script and its test need it

    protos = sorted(PROTO_ROOT.glob("rlfleet/v1/*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / 'rlfleet/v1'}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    generated = sorted((out_dir / "rlfleet" / "v1").glob("*_pb2*.py*"))
    # Services without RPCs still get an (empty) grpc module; keep only those with content.
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=ROOT, help="directory that receives rlfleet/v1/ (default: repo root)"
    )
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
