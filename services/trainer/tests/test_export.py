"""The Hugging Face export of a checkpoint: a base model that does not match it is refused instead of exported as
part of what was trained, an --out in use is refused, a failure writing into an empty --out leaves it empty, and the
long phases are reported."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.tiny_model import TinyModelConfig, create_tiny_model
from rlfleet_trainer import export
from rlfleet_trainer.checkpoint import CheckpointMeta, TrainingState, save_checkpoint
from rlfleet_trainer.export import export_checkpoint
from rlfleet_trainer.policy import load_policy

SMALL = TinyModelConfig(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128)


def trained_checkpoint(model_dir: Path, root: Path) -> tuple[torch.nn.Module, Path]:
    """The policy of `model_dir` after one AdamW step on random tokens, and its checkpoint under `root`."""
    torch.manual_seed(0)
    model = load_policy(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    ids = torch.randint(3, 40, (2, 10))  # (B, T)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, save_checkpoint(root, TrainingState(model, optimizer, schedule), CheckpointMeta(step=1))


def test_a_base_of_fewer_layers_is_refused_naming_the_tensors_it_has_no_place_for(tmp_path: Path) -> None:
    """DCP reads the tensors the model asks for: a 2-layer base of the same width took the first two of the four
    trained layers and was exported as a model without a word."""
    create_tiny_model(tmp_path / "deep", TinyModelConfig(**{**SMALL.__dict__, "layers": 4}))
    create_tiny_model(tmp_path / "shallow", SMALL)
    _, path = trained_checkpoint(tmp_path / "deep", tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"has no place for: model\.layers\.2\..* and \d+ more") as refused:
        export_checkpoint(path, tmp_path / "shallow", tmp_path / "out")
    assert f"does not hold the weights of the llama model at {tmp_path / 'shallow'}" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_base_that_ties_what_the_checkpoint_trained_apart_is_refused(tmp_path: Path) -> None:
    """Read into a model that ties them, the trained lm_head and embeddings went into one tensor: the one read last
    won, and the export gave other logits than the policy."""
    untied = tmp_path / "untied"
    create_tiny_model(untied, SMALL)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model, path = trained_checkpoint(untied, tmp_path / "checkpoints")
    assert not torch.equal(model.state_dict()["lm_head.weight"], model.state_dict()["model.embed_tokens.weight"])
    create_tiny_model(tmp_path / "tied", SMALL)
    with pytest.raises(ValueError, match="holds different tensors as model.embed_tokens.weight and lm_head.weight"):
        export_checkpoint(path, tmp_path / "tied", tmp_path / "out")

    exported = AutoModelForCausalLM.from_pretrained(str(export_checkpoint(path, untied, tmp_path / "out")))
    ids = torch.tensor([[5, 20, 15, 21, 33]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_an_out_holding_files_is_refused(small_model_dir: Path, tmp_path: Path) -> None:
    """Written among an earlier export's shards, the model was served with them: vLLM reads the files an old
    model.safetensors.index.json names."""
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(FileExistsError, match=f"{out} is not an empty directory; choose another --out"):
        export_checkpoint(path, small_model_dir, out)
    assert [p.name for p in out.iterdir()] == ["model.safetensors.index.json"]


def test_a_failure_moving_into_an_empty_out_leaves_it_empty(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty --out (a mounted volume) is filled file by file: a failure halfway left config.json and part of the
    rest there, a directory that looked like a model, and a rerun was refused for it."""
    model, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    out = tmp_path / "out"
    out.mkdir()
    moved: list[str] = []
    replace = export.os.replace

    def fail_on_the_third(source: Path, dest: Path) -> None:
        if len(moved) == 2:
            raise OSError(28, "No space left on device")
        moved.append(Path(dest).name)
        replace(source, dest)

    monkeypatch.setattr(export.os, "replace", fail_on_the_third)
    with pytest.raises(OSError, match="No space left on device"):
        export_checkpoint(path, small_model_dir, out)
    assert "config.json" not in moved  # moved last: even a kill halfway leaves no directory that looks whole
    assert list(out.iterdir()) == []
    monkeypatch.undo()

    export_checkpoint(path, small_model_dir, out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # nothing staged left behind
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(str(out)).chat_template


def test_a_checkpoints_directory_is_refused_naming_its_checkpoints(small_model_dir: Path, tmp_path: Path) -> None:
    """The run's checkpoints/ instead of one step in it: 'its .metadata file is missing' did not say what to name."""
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    with pytest.raises(FileNotFoundError, match=f"--checkpoint: {path.parent} holds checkpoints \\(step_1\\), not one"):
        export_checkpoint(path.parent, small_model_dir, tmp_path / "out")


def test_export_reports_its_phases(small_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Minutes of reading and writing for a real model were silent until the end."""
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    with caplog.at_level(logging.INFO, logger="rlfleet_trainer.export"):
        out = export_checkpoint(path, small_model_dir, tmp_path / "out")
    said = [record.getMessage() for record in caplog.records if record.name == "rlfleet_trainer.export"]
    assert said[0].startswith(f"export: building the llama model of {small_model_dir}")
    assert f"export: reading the policy's weights of {path}" in said
    assert any(
        line.startswith("export: writing ") and line.endswith(f" of torch.float32 tensors to {out}") for line in said
    )
    assert said[-1].startswith(f"export: wrote {out} in ")
