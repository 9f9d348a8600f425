"""`rlfleet model init` writes a standard Hugging Face model directory any HF tool loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.char_tokenizer import CHARACTERS
from rlfleet.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "model", "init", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "M-parameter model" in result.stdout
    return out


def test_loads_with_auto_classes(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < params < 10_000_000
    assert (model_dir / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0
    assert len(tokenizer) == model.config.vocab_size


def test_tokenizer_is_character_level_and_round_trips(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "37+45=\n82 Answer: {x}"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert len({tokenizer.convert_tokens_to_ids(c) for c in CHARACTERS}) == len(CHARACTERS)


def test_forward_pass_gives_finite_logits(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, 6, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_refuses_to_overwrite_a_model(model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "model", "init", "--out", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "already holds a model" in result.stderr


def test_refuses_a_directory_that_holds_anything(tmp_path: Path) -> None:
    """Only config.json was looked for: a tokenizer.json or weights of the user's there were written over."""
    (tmp_path / "tokenizer.json").write_text("mine")
    with pytest.raises(FileExistsError, match="is not an empty directory; choose another --out"):
        create_tiny_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
    assert (tmp_path / "tokenizer.json").read_text() == "mine"


def test_bad_shape_is_refused_with_the_fix(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "model", "init", "--out", str(tmp_path / "m"), "--heads", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "multiple of heads" in result.stderr
    assert not (tmp_path / "m").exists()
