"""The Hugging Face export of a checkpoint: a base model that does not match it is refused instead of exported as
part of what was trained, an --out in use (or made while exporting) is refused, a failure writing into an empty --out
leaves it empty, what a killed export staged is deleted by the next, the model is built without initialising it, and
the long phases are reported."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.tiny_model import TinyModelConfig, create_tiny_model
from rlfleet_trainer import export
from rlfleet_trainer.__main__ import main
from rlfleet_trainer.export import export_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from trained_checkpoints import SMALL, trained_checkpoint  # noqa: E402


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
        line.startswith("export: writing ")
        and line.endswith(f" of torch.float32 tensors, in files of at most 5GB, to {out}")
        for line in said
    )
    assert said[-1].startswith(f"export: wrote {out} in ")


def test_the_model_is_built_without_initialising_its_weights(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from its config on the CPU, the model was randomly initialised, every tensor of it, before the checkpoint
    overwrote them all: minutes on a large model (27 s for a Llama of 0.95B parameters on two cores)."""
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    initialised: list[str] = []

    def recording(reset: Callable[[Any], None]) -> Callable[[Any], None]:
        def recorded(module: Any) -> None:
            initialised.append(str(module.weight.device))
            reset(module)

        return recorded

    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", recording(torch.nn.Linear.reset_parameters))
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", recording(torch.nn.Embedding.reset_parameters))
    export_checkpoint(path, small_model_dir, tmp_path / "out")
    assert initialised and set(initialised) == {"meta"}


def test_a_base_of_more_layers_than_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """The model is given memory without initialising it: a tensor the checkpoint does not hold would be exported
    as whatever that memory held."""
    create_tiny_model(tmp_path / "shallow", SMALL)
    create_tiny_model(tmp_path / "deep", TinyModelConfig(**{**SMALL.__dict__, "layers": 4}))
    _, path = trained_checkpoint(tmp_path / "shallow", tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"Missing key in checkpoint state_dict: model\.model\.layers\.2\."):
        export_checkpoint(path, tmp_path / "deep", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_path_without_a_checkpoint_is_refused_before_the_model_is_built(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped --checkpoint was found only once the model had been built (minutes and its fp32 memory)."""
    built: list[object] = []
    build = export.AutoModelForCausalLM.from_config

    def recorded(*args: object, **kwargs: object) -> object:
        built.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(export.AutoModelForCausalLM, "from_config", recorded)
    missing = tmp_path / "step_7"
    with pytest.raises(FileNotFoundError, match=f"--checkpoint: no checkpoint at {missing} \\(its .metadata file"):
        export_checkpoint(missing, small_model_dir, tmp_path / "out")
    assert built == [] and not (tmp_path / "out").exists()


def test_an_out_made_while_exporting_is_not_replaced(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new --out was put in place with the replace of a weight version: a directory made there meanwhile (another
    export's, a user's) was moved aside and deleted."""
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    out = tmp_path / "out"
    load = export.load_model_weights

    def load_while_another_writes_out(checkpoint: Path, model: torch.nn.Module) -> None:
        out.mkdir()
        (out / "theirs.txt").write_text("kept")
        load(checkpoint, model)

    monkeypatch.setattr(export, "load_model_weights", load_while_another_writes_out)
    with pytest.raises(FileExistsError, match=f"{out} was made while the model was exported; choose another --out"):
        export_checkpoint(path, small_model_dir, out)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and (out / "theirs.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # its staging deleted


KILLED_EXPORT = """
import os, signal, sys
from pathlib import Path
from rlfleet_trainer import export

checkpoint, base, out = (Path(arg) for arg in sys.argv[1:])
replace, rename = os.replace, Path.rename

def killed_moving_in(source, dest):  # the staged model is complete, nothing is in --out yet
    if Path(dest).parent == out:
        os.kill(os.getpid(), signal.SIGKILL)
    replace(source, dest)

def killed_renaming_into_place(self, target):
    if Path(target) == out:
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(self, target)

os.replace = killed_moving_in
Path.rename = killed_renaming_into_place
export.export_checkpoint(checkpoint, base, out)
"""


@pytest.mark.parametrize("out_exists", [True, False], ids=["empty-out", "new-out"])
def test_what_a_killed_export_staged_is_deleted_by_the_next_one(
    out_exists: bool, small_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hard kill left the whole model staged: in an empty --out (a mounted volume) that made it a directory holding
    files, which every later export refused; beside a new one, GBs that no export deleted."""
    model, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    out = tmp_path / "exports" / "out"
    out.mkdir(parents=True) if out_exists else out.parent.mkdir()
    command = [sys.executable, "-c", KILLED_EXPORT, str(path), str(small_model_dir), str(out)]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    staged_in = out if out_exists else out.parent
    left = [p.name for p in staged_in.iterdir() if p.name.startswith(".")]
    assert len(left) == 1 and (staged_in / left[0] / "config.json").exists(), left

    args = ["export", "--checkpoint", str(path), "--base-model", str(small_model_dir), "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0)


def test_what_a_running_export_staged_is_kept(small_model_dir: Path, tmp_path: Path) -> None:
    """An export still writing into an empty --out (its process alive) keeps its staging, and --out is refused."""
    _, path = trained_checkpoint(small_model_dir, tmp_path / "checkpoints")
    out = tmp_path / "out"
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        staged = out / f".export.tmp-{running.pid}-0123abcd-0123456789ab"
        staged.mkdir(parents=True)
        with pytest.raises(FileExistsError, match=f"{out} is not an empty directory"):
            export_checkpoint(path, small_model_dir, out)
        assert staged.is_dir()
    finally:
        running.kill()
        running.wait()
