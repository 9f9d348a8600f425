"""The export's safetensors shards: `--max-shard-size` splits a model into files of at most that size with the
model.safetensors.index.json transformers writes, which every loader of an exported model reads; a size that reads
as none is refused naming the option."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlfleet_trainer import export
from rlfleet_trainer.__main__ import build_parser, main
from rlfleet_trainer.export import export_checkpoint
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.shard_size import parse_shard_size

sys.path.insert(0, str(Path(__file__).parent))
from trained_checkpoints import trained_checkpoint  # noqa: E402

INDEX = "model.safetensors.index.json"


@pytest.mark.parametrize("out_exists", [False, True], ids=["new-out", "empty-out"])
def test_a_model_larger_than_max_shard_size_is_written_in_shards_with_their_index(
    out_exists: bool, small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There was no --max-shard-size: a model was one file of up to transformers' default, 50GB since its version 5
    (a 7B model in bf16 a single 14 GB file)."""
    model, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    moved: list[str] = []
    replace = export.os.replace

    def recorded(source: Path, dest: Path) -> None:
        moved.append(Path(dest).name)
        replace(source, dest)

    monkeypatch.setattr(export.os, "replace", recorded)
    export_checkpoint(path, small_model_dir, out, max_shard_size="40KB")

    index = json.loads((out / INDEX).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert all(name == f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, name in enumerate(shards, 1))
    written: dict[str, torch.Tensor] = {}
    for name in shards:
        with safe_open(str(out / name), "pt") as shard:
            tensors = {key: shard.get_tensor(key) for key in shard.keys()}  # noqa: SIM118 - safe_open is no dict
        assert (out / name).stat().st_size <= 40_000 or len(tensors) == 1  # a tensor larger than a shard: alone
        assert all(index["weight_map"][key] == name for key in tensors)
        written |= tensors
    assert set(written) == set(index["weight_map"]) == set(model.state_dict()) - {"lm_head.weight"}  # tied: once
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    if out_exists:  # every shard before the index, the index before config.json
        assert moved[-2:] == [INDEX, "config.json"] and set(shards) <= set(moved[:-2])

    for loaded in (AutoModelForCausalLM.from_pretrained(str(out)), load_policy(out)):
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_shards_are_at_most_5gb_by_default(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    sizes: list[int | None] = []
    stage = export.stage_model_dir

    def recorded(*args: object, max_shard_size: int | None = None, **kwargs: object) -> Path:
        sizes.append(max_shard_size)
        return stage(*args, max_shard_size=max_shard_size, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(export, "stage_model_dir", recorded)
    out = export_checkpoint(path, small_model_dir, tmp_path / "out")
    assert sizes == [5 * 10**9] and (out / "model.safetensors").exists() and not (out / INDEX).exists()
    parsed = build_parser().parse_args(["export", "--checkpoint", "c", "--base-model", "b", "--out", "o"])
    assert parse_shard_size(parsed.max_shard_size) == 5 * 10**9


@pytest.mark.parametrize(
    ("given", "size"),
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1.5kb", 1500), (" 2 TiB ", 2 * 2**40), ("123", 123), (7, 7)],
)
def test_a_shard_size_is_bytes_or_a_number_with_a_unit(given: str | int, size: int) -> None:
    assert parse_shard_size(given) == size


@pytest.mark.parametrize("given", ["5XB", "GB", "-1GB", "five", "0", "0.1B", ""])
def test_a_shard_size_that_is_no_size_is_refused_naming_the_option(
    given: str, small_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=f"--max-shard-size {given!r} is (not a size|under one byte).*e.g. 5GB"):
        export_checkpoint(tmp_path / "step_1", small_model_dir, tmp_path / "out", max_shard_size=given)
    args = ["export", "--checkpoint", "c", "--base-model", "b", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stopped:
        main([*args, f"--max-shard-size={given}"])
    assert stopped.value.code == 2
    assert f"argument --max-shard-size: {given!r} is " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
