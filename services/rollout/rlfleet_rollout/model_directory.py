"""The policy's model directory, checked at submit as the trainer checks it at the run's start.

The orchestrator sees model paths as the trainer does: every deployment mounts the same storage at
the same path in both (compose and Helm: the shared `data` volume at /data, read-only here; `rlfleet
up`: one machine), which submit already relies on to read `model.tokenizer_path`. So a path with no
model behind it is refused when the run is submitted instead of when it reaches the trainer.
"""

from __future__ import annotations

from pathlib import Path

from rlfleet.errors import InvalidInput


def require_model_config(model_path: str) -> None:
    """InvalidInput naming model.path unless it holds a Hugging Face model's config.json."""
    if not (Path(model_path) / "config.json").is_file():
        raise InvalidInput(
            f"model.path: no Hugging Face model at {model_path!r} (config.json missing); point it at the "
            "directory holding the policy's config.json and weights, on the storage the trainer shares"
        )
