"""The policy's model directory: checked at submit as the trainer checks it at the run's start, and read for
the model's context length, which bounds what a generation may ask for.

The orchestrator sees model paths as the trainer does: every deployment mounts the same storage at
the same path in both (compose and Helm: the shared `data` volume at /data, read-only here; `rlfleet
up`: one machine), which submit already relies on to read `model.tokenizer_path`. So a path with no
model behind it is refused when the run is submitted instead of when it reaches the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlfleet.errors import InvalidInput


def require_model_config(model_path: str) -> None:
    """InvalidInput naming model.path unless it holds a Hugging Face model's config.json."""
    if not (Path(model_path) / "config.json").is_file():
        raise InvalidInput(
            f"model.path: no Hugging Face model at {model_path!r} (config.json missing); point it at the "
            "directory holding the policy's config.json and weights, on the storage the trainer shares"
        )


# Names Hugging Face configs give the context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model_path: str) -> int:
    """The model's context length in tokens from its config.json; 0 when it does not say."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
