"""Loading the policy sharded over two ranks (real torchrun processes, gloo): only rank 0 reads the weights, every
rank ends up with its shard of exactly what a plain from_pretrained loads, buffers included, with the tied
embedding and lm_head still one parameter; a model rank 0 cannot read fails the load on every rank, which stay in
step. That two ranks then train like one is test_fsdp_equivalence.py's."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))

from torchrun_jobs import SCRIPTS, finish, torchrun  # noqa: E402


@pytest.mark.e2e
def test_two_ranks_load_their_shards_of_the_weights_rank_0_alone_reads(small_model_dir: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config_only"  # what rank 1 is given: reading weights there fails
    config_only.mkdir()
    shutil.copy2(small_model_dir / "config.json", config_only / "config.json")
    broken = tmp_path / "broken"
    shutil.copytree(small_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"garbage" * 10)
    out = tmp_path / "out"
    out.mkdir()
    args = [str(SCRIPTS / "sharded_load.py"), str(small_model_dir), str(config_only), str(broken), str(out)]
    finish(torchrun(2, args, tmp_path / "ranks.log"), timeout_s=180)
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]

    plain = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32)
    expected = plain.state_dict()
    expected_buffers = dict(plain.named_buffers())
    assert "model.rotary_emb.inv_freq" in expected_buffers  # computed in __init__, in no state dict
    elements = sum(p.numel() for p in plain.parameters())
    for part, trainable in (("policy", True), ("reference", False)):
        gathered = ranks[0][part]["full_state"]
        assert gathered.keys() == expected.keys(), part
        for name, tensor in expected.items():
            assert gathered[name].dtype == tensor.dtype == torch.float32, f"{part}: {name}"
            assert torch.equal(gathered[name], tensor), f"{part}: {name} differs from from_pretrained's"
        assert ranks[1][part]["full_state"] == {}
        for rank, results in enumerate(ranks):
            held, where = results[part], f"{part} on rank {rank}"
            assert held["sharded"] and held["tied"], where
            # Each rank holds a share of the weights, not a whole copy (the tied parameter counted once).
            assert 0 < held["local_elements"] < elements, where
            assert held["buffers"].keys() == expected_buffers.keys(), where
            for name, buffer in expected_buffers.items():
                got = held["buffers"][name]
                assert got.dtype == buffer.dtype and torch.equal(got, buffer), f"{where}: buffer {name}"
            assert held["requires_grad"] == {trainable}, where
            assert held["training"] is False and held["use_cache"] is False, where  # as from_pretrained leaves it
    assert sum(results["policy"]["local_elements"] for results in ranks) == elements

    # Rank 0's failure to read the weights reaches rank 1 instead of leaving it waiting in the load's collectives.
    assert ranks[0]["broken"] is not None and "SafetensorError" in ranks[0]["broken"], ranks[0]["broken"]
    assert ranks[1]["broken"] == ranks[0]["broken"]
