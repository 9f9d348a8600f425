"""The policy's tokenizer (`tokenizer.json`, read with the `tokenizers` library: no transformers, no torch)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from rlfleet.errors import InvalidInput


def tokenizer_file(tokenizer_path: str) -> Path:
    """The tokenizer.json of a model or tokenizer directory; InvalidInput naming the field when absent."""
    path = Path(tokenizer_path) / "tokenizer.json"
    if not path.is_file():
        raise InvalidInput(
            f"model.tokenizer_path: {tokenizer_path!r} has no tokenizer.json (the orchestrator tokenizes prompts "
            "with it; point model.tokenizer_path at a directory that has one)"
        )
    return path


def load_tokenizer(tokenizer_path: str) -> Tokenizer:
    path = tokenizer_file(tokenizer_path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for unreadable files
        raise InvalidInput(f"model.tokenizer_path: cannot read {path}: {exc}") from exc
