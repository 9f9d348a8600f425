"""Weight versions on disk: each version is a complete Hugging Face model directory.

A version is written to a temporary directory, flushed to disk and renamed into place
(`directory_swap`), so a crash never leaves a half-written `v<N>` that looks complete; engines (or a
restarted trainer) can load any kept version.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedModel

from rlfleet_trainer.directory_swap import replace_directory

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def version_dir(weights_root: Path, version: int) -> Path:
    return weights_root / f"v{version}"


def write_model_dir(
    model: PreTrainedModel, dest: Path, tokenizer_dir: Path, state_dict: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """Writes `model` (safetensors + config) and the tokenizer files of `tokenizer_dir` as the
    Hugging Face directory `dest`, replacing it atomically. `state_dict` replaces the model's own
    tensors: a sharded model passes its gathered full weights."""
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = None if state_dict is None else dict(state_dict)
    model.save_pretrained(str(tmp), state_dict=tensors, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    replace_directory(tmp, dest)  # an existing one is a leftover from a step that was rolled back
    return dest


def save_version(
    model: PreTrainedModel,
    weights_root: Path,
    version: int,
    tokenizer_dir: Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Writes `model` (or `state_dict` in its shape) as weight version `version`; returns its directory."""
    return write_model_dir(model, version_dir(weights_root, version), tokenizer_dir, state_dict)


def prune_versions(weights_root: Path, keep_from: int) -> None:
    """Deletes published versions older than `keep_from`."""
    for path in weights_root.glob("v*"):
        suffix = path.name[1:]
        if suffix.isdigit() and int(suffix) < keep_from:
            shutil.rmtree(path, ignore_errors=True)
