"""The `transformers` backend: a Hugging Face causal LM on CPU with a batched, growable KV cache.

Rows are left-padded: every row's cache has the same length T, padding sits on the left and is
masked out by the 2-D attention mask, and each row carries its own position ids (RoPE sees 0..n-1
for the row's real tokens whatever its padding). New rows are prefilled on their own (equal prompts,
the `n` samples of one, once) and merged into the running batch by left-padding the shorter of the two
caches, which is what lets requests join between decode steps (continuous batching). A decode step
writes into the room the cache's buffers keep (`kv_buffers`), never copying the cache. Padded cache
slots hold zeros and are never attended to, so a row's logits do not depend on what else is in the
batch (the tests hold this to 1e-4 against a plain forward pass).

Supports decoder-only models whose every layer has a full (not sliding-window) KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache

from rlfleet_engine.kv_buffers import GrowingLayer, merged, selected
from rlfleet_engine.weight_loading import (
    check_shapes,
    copy_tensors_into,
    load_state_into,
    parameter_names,
    read_safetensors_dir,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersBackend:
    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        context_length: int | None = None,
        tokenizer_eos_token_ids: Collection[int] = (),
    ) -> None:
        config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=_DTYPES[dtype], attn_implementation="sdpa"
        ).eval()
        self.config = config
        _require_full_attention(self.model.config)
        self.vocab_size = int(config.vocab_size)
        model_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.context_length = min(context_length, model_context) if context_length else model_context
        # As SGLang: the config's eos ids, the generation config's and the tokenizer's all end a sequence.
        self.eos_token_ids = frozenset(
            [
                *_ids(getattr(config, "eos_token_id", None)),
                *_ids(getattr(self.model.generation_config, "eos_token_id", None)),
                *tokenizer_eos_token_ids,
            ]
        )
        self._pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self._layers: list[GrowingLayer] = []  # per layer: keys, values (B, H, T, D) with room to grow
        self._mask = torch.zeros((0, 0), dtype=torch.long)  # (B, T): 1 where the cache holds a real token
        self._next_pos = torch.zeros((0,), dtype=torch.long)  # (B,): position id of each row's next token

    @property
    def rows(self) -> int:
        return int(self._mask.shape[0])

    @torch.inference_mode()
    def add(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prefills `prompts` as new rows; equal prompts (the `n` samples of one) are computed once and copied."""
        assert prompts and all(prompts), "every prompt needs at least one token"
        unique: dict[tuple[int, ...], int] = {}
        source = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts], dtype=torch.long)  # (n,)
        distinct = list(unique)
        lengths = torch.tensor([len(p) for p in distinct], dtype=torch.long)
        width = int(lengths.max())
        ids = torch.full((len(distinct), width), self._pad_id, dtype=torch.long)  # (u, L)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)  # (u, L)
        for i, prompt in enumerate(distinct):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (u, L)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv = _tensors(out.past_key_values)
        new_mask = mask
        if len(distinct) < len(prompts):  # the samples of one prompt each take a copy of its row
            kv = [(k.index_select(0, source), v.index_select(0, source)) for k, v in kv]
            new_mask = mask.index_select(0, source)  # (n, L)
        if self.rows:
            self._layers = merged([[layer.cached() for layer in self._layers], kv])
            total = max(width, self._mask.shape[1])
            self._mask = torch.cat([_left_padded(self._mask, total), _left_padded(new_mask, total)], dim=0)
        else:
            self._layers, self._mask = merged([kv]), new_mask
        self._next_pos = torch.cat([self._next_pos, lengths.index_select(0, source)], dim=0)
        return out.logits[:, -1, :].float().index_select(0, source)  # (n, V)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        assert len(tokens) == self.rows, f"step needs one token per running row ({self.rows}), got {len(tokens)}"
        mask = torch.cat([self._mask, torch.ones((self.rows, 1), dtype=torch.long)], dim=1)  # (B, T+1)
        out = self.model(
            input_ids=torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1),  # (B, 1)
            attention_mask=mask,
            position_ids=self._next_pos.unsqueeze(1),  # (B, 1)
            past_key_values=Cache(layers=list(self._layers)),  # written in place: no copy of the cache
            use_cache=True,
        )
        self._mask = mask
        self._next_pos = self._next_pos + 1
        return out.logits[:, -1, :].float()  # (B, V)

    def keep(self, rows: Sequence[int]) -> None:
        if len(rows) == self.rows:
            return
        index = torch.tensor(list(rows), dtype=torch.long)
        mask = self._mask.index_select(0, index)
        # Columns that are padding in every remaining row are dead weight: drop them from the left.
        live = mask.any(dim=0).nonzero()
        start = int(live[0]) if live.numel() else mask.shape[1]
        self._mask = mask[:, start:]
        self._next_pos = self._next_pos.index_select(0, index)
        self._layers = selected(self._layers, index, start) if len(rows) else []

    def load_weights(self, model_path: str) -> None:
        load_state_into(self.model, read_safetensors_dir(model_path), model_path)

    def check_tensors(self, shapes: Sequence[tuple[str, tuple[int, ...]]], source: str) -> None:
        check_shapes(self.model, shapes, source)

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        copy_tensors_into(self.model, tensors, source)

    def parameter_names(self) -> dict[str, str]:
        return parameter_names(self.model)

    def describe(self) -> dict[str, Any]:
        return {
            "model_type": getattr(self.config, "model_type", None),
            "architectures": getattr(self.config, "architectures", None),
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
        }


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError("rlfleet-engine supports only models whose every layer keeps a full key/value cache")
        out.append((keys, values))
    return out


def _left_padded(mask: torch.Tensor, width: int) -> torch.Tensor:
    """`mask` (B, T) with zero columns on its left up to `width` columns."""
    extra = width - mask.shape[1]
    if extra <= 0:
        return mask
    return torch.cat([torch.zeros((mask.shape[0], extra), dtype=mask.dtype), mask], dim=1)


def tokenizer_eos_token_ids(tokenizer: Any) -> list[int]:
    """The tokens a tokenizer ends a sequence with, as SGLang reads them: its eos token and, when it has one,
    Llama 3's `<|eom_id|>` (SGLang's `additional_stop_token_ids`)."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    eom = tokenizer.get_added_vocab().get("<|eom_id|>") if hasattr(tokenizer, "get_added_vocab") else None
    return ids if eom is None else [*ids, eom]


def _ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _require_full_attention(config: Any) -> None:
    """ValueError unless every layer of the model keeps a full key/value cache (the only kind the batch holds)."""
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds - {"DynamicLayer"}:
        raise ValueError(
            f"rlfleet-engine supports only models whose every layer keeps a full key/value cache; this one has "
            f"{sorted(kinds)} layers (sliding-window or linear attention): serve it with --backend sglang"
        )
