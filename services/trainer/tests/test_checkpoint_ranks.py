"""A run resumes on another number of trainer ranks: a checkpoint saved by 1 rank loads on 2 and one
saved by 2 loads on 1 (real torchrun processes, gloo, FSDP2 on 2), and the step after it is the one
the saving job took (model, optimizer moments and schedule restored, resharded by DCP)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfleet_trainer.export import export_checkpoint
from rlfleet_trainer.policy import load_policy

sys.path.insert(0, str(Path(__file__).parent))

from checkpoint_files import flip_a_bit  # noqa: E402
from torchrun_jobs import SCRIPTS, finish, torchrun  # noqa: E402

SCRIPT = str(SCRIPTS / "checkpoint_ranks.py")
TOLERANCE = 1e-5


def run_all(jobs: dict[str, tuple[int, list[str]]], tmp_path: Path) -> None:
    started = [torchrun(nproc, [SCRIPT, *args], tmp_path / f"{name}.log") for name, (nproc, args) in jobs.items()]
    for job in started:  # both at once: each is mostly start-up time
        finish(job, 240)


@pytest.mark.e2e
def test_checkpoint_resumes_on_more_and_on_fewer_ranks(small_model_dir: Path, tmp_path: Path) -> None:
    model = str(small_model_dir)
    out = {name: str(tmp_path / f"{name}.pt") for name in ("saved1", "saved2", "loaded2", "loaded1")}
    roots = {n: str(tmp_path / f"checkpoints{n}") for n in (1, 2)}
    run_all(
        {
            "saved1": (1, ["save", model, roots[1], out["saved1"]]),
            "saved2": (2, ["save", model, roots[2], out["saved2"]]),
        },
        tmp_path,
    )
    saved2 = Path(roots[2]) / "step_1"
    listed = sorted(line.split("  ")[1] for line in (saved2 / "SHA256SUMS").read_text().splitlines())
    assert listed == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank summed the shard it wrote
    summed = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=saved2, capture_output=True)
    assert summed.returncode == 0, summed
    damaged = tmp_path / "damaged"
    shutil.copytree(roots[2], damaged)
    shard = flip_a_bit(damaged / "step_1", "__0_0.distcp")  # rank 1's share of the check on 2 ranks
    run_all(
        {
            "loaded2": (2, ["load", model, roots[1], out["loaded2"]]),
            "loaded1": (1, ["load", model, roots[2], out["loaded1"]]),
            "refused2": (2, ["refuse", model, str(damaged), str(tmp_path / "refused")]),
        },
        tmp_path,
    )
    for rank in (0, 1):  # each rank hears of the file, whichever rank checked it, instead of waiting in DCP's load
        raised = (tmp_path / f"refused.rank{rank}").read_text()
        assert raised.startswith("damaged=True") and f"{shard} has SHA-256" in raised, raised

    weights = {name: torch.load(path) for name, path in out.items()}
    base = load_policy(small_model_dir).state_dict()
    # Exported on one process, the checkpoint two FSDP ranks wrote is the model one rank trained.
    exported = {
        n: load_policy(export_checkpoint(Path(roots[n]) / "step_1", small_model_dir, tmp_path / f"export{n}"))
        for n in (1, 2)
    }
    for name, tensor in exported[1].state_dict().items():
        assert not torch.equal(tensor, base[name]), f"{name} was not trained"
        diff = float((exported[2].state_dict()[name] - tensor).abs().max())
        assert diff <= TOLERANCE, f"exported from 2 ranks vs 1: {name} differs by {diff}"
    assert any(not torch.equal(base[name], tensor) for name, tensor in weights["loaded2"].items()), "nothing trained"
    for resumed, original in (("loaded2", "saved1"), ("loaded1", "saved2"), ("saved2", "saved1")):
        assert weights[resumed].keys() == weights[original].keys()
        for name, tensor in weights[original].items():
            diff = float((weights[resumed][name] - tensor).abs().max())
            assert diff <= TOLERANCE, f"{resumed} vs {original}: {name} differs by {diff}"
