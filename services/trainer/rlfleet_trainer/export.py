"""Hugging Face export of a checkpoint: safetensors, config and tokenizer, loadable with
AutoModelForCausalLM and servable by the engines.

    python -m rlfleet_trainer export --checkpoint DIR --base-model DIR --out DIR [--tokenizer DIR]

The architecture comes from the base model's config (a checkpoint holds tensors, not a config); only
the policy's tensors are read from the checkpoint, whatever the sharding it was saved with. The base's
generation_config.json (its end-of-turn token ids, its sampling defaults) is kept, with every tokenizer
file of the run's tokenizer (`--tokenizer`: the run's model.tokenizer_path when it set one, else the
base). The tensors are written in the base's dtype (a bfloat16 base is exported in bfloat16, half the
bytes of the fp32 the trainer keeps), which config.json names.

Every policy tensor of the checkpoint is exported or the export is refused: a base with fewer layers, or one that
ties tensors the checkpoint holds apart, would give a model missing part of what was trained. PPO's critic head is
not exported (the checkpoint keeps it beside the policy). The export holds the policy once, in fp32 (4 bytes a
parameter), and logs each phase.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from rlfleet_trainer.checkpoint import CheckpointFailed, load_model_weights
from rlfleet_trainer.weights import base_dtype, tokenizer_files, write_model_dir

logger = logging.getLogger(__name__)

LAST_MOVED = ("model.safetensors.index.json", "config.json")
"""Moved into an existing --out after every other file, the index after its shards and config.json last: a directory
that a crash left part-filled lacks what a loader reads first, instead of looking like a whole model."""


def export_checkpoint(checkpoint: Path, base_model: Path, out: Path, tokenizer: Path | None = None) -> Path:
    """Writes the policy of `checkpoint` as the Hugging Face directory `out` (new, or an empty directory, which
    may be a mount point) with the tokenizer at `tokenizer` (by default the base's) and returns it."""
    out = out.resolve()
    # A model written over another's files would be loaded with what those leave: vLLM reads the shards an old
    # model.safetensors.index.json names.
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} is not an empty directory; choose another --out")
    if not (base_model / "config.json").exists():
        raise FileNotFoundError(f"--base-model: no Hugging Face model at {base_model} (config.json missing)")
    tokenizer = base_model if tokenizer is None else tokenizer
    if not tokenizer_files(tokenizer):
        option = "--base-model" if tokenizer == base_model else "--tokenizer"
        raise FileNotFoundError(
            f"{option}: no tokenizer files at {tokenizer}; name the run's model.tokenizer_path with --tokenizer"
        )
    steps = sorted(path.name for path in checkpoint.glob("step_*") if (path / ".metadata").exists())
    if steps and not (checkpoint / ".metadata").exists():
        raise FileNotFoundError(f"--checkpoint: {checkpoint} holds checkpoints ({', '.join(steps)}), not one: name one")
    started = time.monotonic()
    config = AutoConfig.from_pretrained(str(base_model))
    logger.info("export: building the %s model of %s in float32", config.model_type, base_model)
    # fp32, the dtype the trainer trains and checkpoints in.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    logger.info("export: reading the policy's weights of %s", checkpoint)
    try:
        load_model_weights(checkpoint, model)
    except RuntimeError as exc:  # CheckpointFailed among them
        if isinstance(exc, CheckpointFailed) and exc.damaged:
            raise ValueError(f"checkpoint {checkpoint} is damaged, restore it from a copy: {exc}") from exc
        raise ValueError(
            f"{checkpoint} does not hold the weights of the {config.model_type} model at {base_model}: {exc}"
        ) from exc
    dtype = getattr(torch, base_dtype(base_model) or "", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        model.to(dtype)
    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    logger.info("export: writing %.2f GB of %s tensors to %s", size_gb, model.dtype, out)
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        written = write_model_dir(model, out, tokenizer, base_dir=base_model)
    else:
        written = _write_into(out, model, tokenizer, base_model)
    logger.info("export: wrote %s in %.0f s", written, time.monotonic() - started)
    return written


def _write_into(out: Path, model: PreTrainedModel, tokenizer: Path, base_model: Path) -> Path:
    """Writes the model into the empty directory `out`, which stays where it is (a volume mounted there cannot be
    renamed): written beside its files, inside it, then moved in (LAST_MOVED last). A failure takes out what was
    moved, leaving `out` empty again."""
    staged = write_model_dir(model, out / ".export", tokenizer, base_dir=base_model)
    entries = sorted(
        staged.iterdir(), key=lambda entry: LAST_MOVED.index(entry.name) if entry.name in LAST_MOVED else -1
    )
    try:
        for entry in entries:
            os.replace(entry, out / entry.name)
    except BaseException:
        for entry in out.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        raise
    staged.rmdir()
    return out
