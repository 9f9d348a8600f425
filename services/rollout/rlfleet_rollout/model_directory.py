"""The policy's model directory: checked at submit as the trainer checks it at the run's start, and read for
the model's context length, which bounds what a generation may ask for.

The orchestrator sees model paths as the trainer does: every deployment mounts the same storage at
the same path in both (compose and Helm: the shared `data` volume at /data, read-only here; `rlfleet
up`: one machine), which submit already relies on to read `model.tokenizer_path`. So a path with no
model behind it is refused when the run is submitted instead of when it reaches the trainer.

Which paths a spec may name at all is here too: with data roots configured (RLFLEET_ROLLOUT_DATA_ROOTS, the shared
storage), a model, tokenizer or dataset path elsewhere is refused before anything is opened, so a client cannot make
the orchestrator read, or say whether it could read, any other file of its host.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import relative_note
from rlfleet.v1.runs_pb2 import RunSpec


def spec_paths(spec: RunSpec) -> Iterator[tuple[str, str]]:
    """(field, path) of every file or directory a resolved spec makes the orchestrator and the trainer read."""
    yield "model.path", spec.model.path
    yield "model.tokenizer_path", spec.model.tokenizer_path
    source = spec.dataset.WhichOneof("source")
    if source is not None and source != "arithmetic":
        files = getattr(spec.dataset, source)
        yield f"dataset.{source}.path", files.path
        yield f"dataset.{source}.eval_path", files.eval_path


def require_under_roots(spec: RunSpec, roots: Sequence[Path]) -> None:
    """InvalidInput naming the first path of `spec` that does not resolve (`..` and symlinks followed) under one of
    `roots`; no roots: every path is allowed. Checked before any of them is opened, and saying nothing about the
    file itself, so the refusal tells whether it exists no more than what it holds."""
    if not roots:
        return
    allowed = [root.resolve() for root in roots]
    for field, path in spec_paths(spec):
        if path and not _under(path, allowed):
            raise InvalidInput(
                f"{field}: {path!r} is not under the storage this orchestrator reads runs' data from "
                f"({', '.join(str(root) for root in allowed)}; RLFLEET_ROLLOUT_DATA_ROOTS); put the files there"
            )


def require_model_config(model_path: str) -> None:
    """InvalidInput naming model.path unless it holds a Hugging Face model's config.json."""
    try:
        found = (Path(model_path) / "config.json").is_file()
    except OSError as exc:  # a name too long, a directory it may not search: not "not there"
        raise InvalidInput(f"model.path: cannot read {model_path!r}: {exc.strerror}") from None
    if not found:
        raise InvalidInput(
            f"model.path: no Hugging Face model at {model_path!r}{relative_note(model_path, 'the orchestrator')} "
            "(config.json missing); point it at the "
            "directory holding the policy's config.json and weights, on the storage the trainer shares"
        )


def _under(path: str, roots: Sequence[Path]) -> bool:
    """Whether `path`, made absolute with `..` and symlinks followed, lies in one of the (resolved) `roots`; a path
    that cannot be resolved (a NUL byte, a symlink loop) lies in none."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(resolved.is_relative_to(root) for root in roots)


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
