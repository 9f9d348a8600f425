"""Hugging Face export of a checkpoint: safetensors, config and tokenizer, loadable with
AutoModelForCausalLM and servable by the engines.

    python -m rlfleet_trainer export --checkpoint DIR --base-model DIR --out DIR

The architecture comes from the base model's config (a checkpoint holds tensors, not a config); only
the policy's tensors are read from the checkpoint, whatever the sharding it was saved with. The base's
generation_config.json (its end-of-turn token ids, its sampling defaults) and every tokenizer file it has are kept.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlfleet_trainer.checkpoint import CheckpointFailed, load_model_weights
from rlfleet_trainer.weights import write_model_dir


def export_checkpoint(checkpoint: Path, base_model: Path, out: Path) -> Path:
    """Writes the policy of `checkpoint` as the Hugging Face directory `out` and returns it."""
    if not (base_model / "config.json").exists():
        raise FileNotFoundError(f"--base-model: no Hugging Face model at {base_model} (config.json missing)")
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
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_model_dir(model, out, base_model, base_dir=base_model)
