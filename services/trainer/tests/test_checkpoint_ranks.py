"""A run resumes on another number of trainer ranks: a checkpoint saved by 1 rank loads on 2 and one
saved by 2 loads on 1 (real torchrun processes, gloo, FSDP2 on 2), and the step after it is the one
the saving job took (model, optimizer moments and schedule restored, resharded by DCP)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlfleet_trainer.policy import load_policy

sys.path.insert(0, str(Path(__file__).parent))

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
    run_all(
        {
            "loaded2": (2, ["load", model, roots[1], out["loaded2"]]),
            "loaded1": (1, ["load", model, roots[2], out["loaded1"]]),
        },
        tmp_path,
    )

    weights = {name: torch.load(path) for name, path in out.items()}
    base = load_policy(small_model_dir).state_dict()
    assert any(not torch.equal(base[name], tensor) for name, tensor in weights["loaded2"].items()), "nothing trained"
    for resumed, original in (("loaded2", "saved1"), ("loaded1", "saved2"), ("saved2", "saved1")):
        assert weights[resumed].keys() == weights[original].keys()
        for name, tensor in weights[original].items():
            diff = float((weights[resumed][name] - tensor).abs().max())
            assert diff <= TOLERANCE, f"{resumed} vs {original}: {name} differs by {diff}"
