"""What the scheduler needs from whatever produces logits: the `GenerationBackend` protocol.

A backend owns the model state of the running batch (for `transformers`, the KV cache). Rows are
kept in the order they were added, minus the rows dropped by `keep`; the scheduler holds its own
list of running requests in the same order, so row i of every logits tensor is request i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch


class GenerationBackend(Protocol):
    vocab_size: int
    """Number of token ids the model scores (rows of logits have this width)."""
    context_length: int
    """Longest sequence (prompt + completion) the model supports."""
    eos_token_ids: frozenset[int]
    """Tokens that end a sequence unless a request sets ignore_eos."""

    def add(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prefills `prompts` as new rows appended to the running batch; returns their next-token logits (n, V)."""
        ...

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Appends one token to every running row (in row order); returns the next-token logits (B, V)."""
        ...

    def keep(self, rows: Sequence[int]) -> None:
        """Keeps only the given rows (ascending indices), dropping the state of all others."""
        ...

    def load_weights(self, model_path: str) -> None:
        """Replaces the weights with those in `model_path`; raises InvalidInput if they do not fit."""
        ...

    def check_tensors(self, shapes: Sequence[tuple[str, tuple[int, ...]]], source: str) -> None:
        """Raises InvalidInput unless each (name, shape) names a weight of the model with that shape."""
        ...

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        """Replaces the named weights (any subset) with `tensors`; raises InvalidInput if they do not fit."""
        ...

    def parameter_names(self) -> Mapping[str, str] | None:
        """The parameters a whole weight version must deliver, for a version sent in several updates (buckets):
        each name the model takes a parameter under, mapped to the parameter it sets (tied names to one, which
        either delivers). None: versions are not checked (nothing here to check them against)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Model facts for /get_model_info (model_type, architectures, ...)."""
        ...
