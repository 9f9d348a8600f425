"""Hugging Face export of a checkpoint: safetensors, config and tokenizer, loadable with
AutoModelForCausalLM and servable by the engines.

    python -m rlfleet_trainer export --checkpoint DIR --base-model DIR --out DIR [--tokenizer DIR]

The architecture comes from the base model's config (a checkpoint holds tensors, not a config); only
the policy's tensors are read from the checkpoint, whatever the sharding it was saved with. The base's
generation_config.json (its end-of-turn token ids, its sampling defaults) is kept, with every tokenizer
file of the run's tokenizer (`--tokenizer`: the run's model.tokenizer_path when it set one, else the
base). The tensors are written in the base's dtype (a bfloat16 base is exported in bfloat16, half the
bytes of the fp32 the trainer keeps), which config.json names.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlfleet_trainer.checkpoint import CheckpointFailed, load_model_weights
from rlfleet_trainer.weights import base_dtype, tokenizer_files, write_model_dir


def export_checkpoint(checkpoint: Path, base_model: Path, out: Path, tokenizer: Path | None = None) -> Path:
    """Writes the policy of `checkpoint` as the Hugging Face directory `out` (new, or an empty directory, which
    may be a mount point) with the tokenizer at `tokenizer` (by default the base's) and returns it."""
    if not (base_model / "config.json").exists():
        raise FileNotFoundError(f"--base-model: no Hugging Face model at {base_model} (config.json missing)")
    tokenizer = base_model if tokenizer is None else tokenizer
    if not tokenizer_files(tokenizer):
        option = "--base-model" if tokenizer == base_model else "--tokenizer"
        raise FileNotFoundError(
            f"{option}: no tokenizer files at {tokenizer}; name the run's model.tokenizer_path with --tokenizer"
        )
    config = AutoConfig.from_pretrained(str(base_model))
    # fp32, the dtype the trainer trains and checkpoints in.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
    out = out.resolve()
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        return write_model_dir(model, out, tokenizer, base_dir=base_model)
    # An empty directory stays where it is (a volume mounted there cannot be renamed): the model is written
    # beside its files, inside it, then moved in.
    staged = write_model_dir(model, out / ".export", tokenizer, base_dir=base_model)
    for entry in staged.iterdir():
        os.replace(entry, out / entry.name)
    staged.rmdir()
    return out
