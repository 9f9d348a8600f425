"""A generation backend for the model core's in-process tests: logits of zeros over a small vocabulary, the
prompts of every prefill recorded, each decode step as slow as asked; and a tokenizer of characters for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

VOCAB = 32


class ZeroLogitsBackend:
    """Records the prompts of every prefill (`prefills`); each decode step takes `step_secs` and sets `stepping`
    as it starts."""

    vocab_size = VOCAB
    context_length = 512
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, step_secs: float = 0.0) -> None:
        self.step_secs = step_secs
        self.stepping = threading.Event()
        self.prefills: list[list[tuple[int, ...]]] = []

    def add(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        self.prefills.append([tuple(p) for p in prompts])
        return torch.zeros((len(prompts), VOCAB))

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        self.stepping.set()
        time.sleep(self.step_secs)
        return torch.zeros((len(tokens), VOCAB))

    def keep(self, rows: Sequence[int]) -> None:
        pass

    def load_weights(self, model_path: str) -> None:
        pass

    def check_tensors(self, shapes: Sequence[tuple[str, tuple[int, ...]]], source: str) -> None:
        pass

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {}


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)
