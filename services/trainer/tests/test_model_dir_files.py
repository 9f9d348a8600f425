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
