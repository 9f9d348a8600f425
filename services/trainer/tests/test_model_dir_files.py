"""What a written model directory (an export, a weight version the engines load) keeps of its base model besides the
weights: its generation_config.json as it is (export wrote one derived from config.json, without the base's list of
end-of-turn token ids and its sampling defaults), and every tokenizer file it has (only four were copied: a
SentencePiece tokenizer.model, a vocab.json + merges.txt tokenizer, added_tokens.json were dropped)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlfleet_trainer.checkpoint import CheckpointMeta, TrainingState, save_checkpoint
from rlfleet_trainer.export import export_checkpoint
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.weights import save_version

# As an instruct model ships them: two end-of-turn ids and sampling defaults; tokenizer files of several kinds.
GENERATION_CONFIG = {"eos_token_id": [1, 2], "pad_token_id": 0, "temperature": 0.7, "top_p": 0.8, "do_sample": True}
EXTRA_TOKENIZER_FILES = {
    "tokenizer.model": b"a SentencePiece model",
    "vocab.json": b'{"a": 0}',
    "merges.txt": b"#version: 0.2\n",
    "added_tokens.json": b'{"<tool>": 100}',
    "additional_chat_templates/tool_use.jinja": b"{{ messages }}",
}


@pytest.fixture
def base(small_model_dir: Path, tmp_path: Path) -> Path:
    base = tmp_path / "base"
    shutil.copytree(small_model_dir, base)
    (base / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=1))
    for name, content in EXTRA_TOKENIZER_FILES.items():
        (base / name).parent.mkdir(exist_ok=True)
        (base / name).write_bytes(content)
    return base


def assert_keeps_the_bases_files(base: Path, written: Path) -> None:
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", *EXTRA_TOKENIZER_FILES]:
        assert (written / name).exists() and (written / name).read_bytes() == (base / name).read_bytes(), name
    assert not (written / "rlfleet_tiny.json").exists()  # not a tokenizer file
    assert json.loads((written / "generation_config.json").read_text()) == GENERATION_CONFIG
    assert (written / "generation_config.json").read_bytes() == (base / "generation_config.json").read_bytes()


def test_export_keeps_the_bases_generation_config_and_every_tokenizer_file(base: Path, tmp_path: Path) -> None:
    model = load_policy(base)
    optimizer = torch.optim.AdamW(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    checkpoint = save_checkpoint(tmp_path / "checkpoints", TrainingState(model, optimizer, schedule), CheckpointMeta(1))
    exported = export_checkpoint(checkpoint, base, tmp_path / "exported")
    assert_keeps_the_bases_files(base, exported)


def test_a_weight_version_keeps_them_too(base: Path, tmp_path: Path) -> None:
    """What the engines load after each step (and a restarted engine from disk)."""
    version = save_version(load_policy(base), tmp_path / "weights", 3, base)
    assert_keeps_the_bases_files(base, version)


def test_a_bfloat16_base_is_named_so_in_versions_and_exported_in_it(small_model_dir: Path, tmp_path: Path) -> None:
    """Versions keep the trainer's fp32 tensors (a CPU engine serves exactly what was trained) and name the base's
    dtype: named float32, as transformers writes it, SGLang's --dtype auto served a bf16 model in float16. The
    export is the base's dtype throughout."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.bfloat16).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(small_model_dir / name, base / name)
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_policy(base)
    version = save_version(model, tmp_path / "weights", 1, base)
    optimizer = torch.optim.AdamW(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    checkpoint = save_checkpoint(tmp_path / "checkpoints", TrainingState(model, optimizer, schedule), CheckpointMeta(1))
    exported = export_checkpoint(checkpoint, base, tmp_path / "exported")

    def tensor_dtypes(model_dir: Path) -> set[torch.dtype]:
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            return {f.get_tensor(key).dtype for key in f.keys()}  # noqa: SIM118 - safe_open is no mapping

    # Under both keys: an engine on a transformers before 4.56 reads torch_dtype alone, and without it took the
    # model for float32 (served in float16).
    for written in (version, exported):
        config = json.loads((written / "config.json").read_text())
        assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert tensor_dtypes(version) == {torch.float32}
    assert tensor_dtypes(exported) == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(exported).dtype == torch.bfloat16


def test_export_takes_the_runs_own_tokenizer_and_refuses_to_export_without_one(
    small_model_dir: Path, tmp_path: Path
) -> None:
    """A run may name its tokenizer apart from the base (model.tokenizer_path), as its weight versions take it;
    the export took the base's alone and, from a base without one, wrote a model no engine could load."""
    base, tokenizer = tmp_path / "weights-only", tmp_path / "tokenizer"
    base.mkdir()
    tokenizer.mkdir()
    for path in small_model_dir.iterdir():
        shutil.copy2(path, (tokenizer if path.name.startswith(("tokenizer", "chat_template")) else base) / path.name)
    model = load_policy(base)
    optimizer = torch.optim.AdamW(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    checkpoint = save_checkpoint(tmp_path / "checkpoints", TrainingState(model, optimizer, schedule), CheckpointMeta(1))
    with pytest.raises(
        FileNotFoundError, match="no tokenizer files at .*weights-only; name the run's model.tokenizer_p"
    ):
        export_checkpoint(checkpoint, base, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    exported = export_checkpoint(checkpoint, base, tmp_path / "exported", tokenizer)
    assert (exported / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()


def test_export_into_an_empty_directory_writes_inside_it(base: Path, tmp_path: Path) -> None:
    """An empty --out stays the directory it is (a volume mounted there cannot be renamed: the export failed
    after writing the whole model beside it, and left it there)."""
    model = load_policy(base)
    optimizer = torch.optim.AdamW(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    checkpoint = save_checkpoint(tmp_path / "checkpoints", TrainingState(model, optimizer, schedule), CheckpointMeta(1))
    out = tmp_path / "mounted" / "out"
    out.mkdir(parents=True)
    inode = out.stat().st_ino
    assert export_checkpoint(checkpoint, base, out) == out
    assert out.stat().st_ino == inode, "written into the directory, not renamed over it"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "nothing left beside it"
    assert not any(p.name.startswith(".") for p in out.iterdir())
    assert_keeps_the_bases_files(base, out)
