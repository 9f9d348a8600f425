"""The `transformers` backend: a Hugging Face causal LM on CPU with a batched, growable KV cache.

Rows are left-padded: every row's cache has the same length T, padding sits on the left and is
masked out by the 2-D attention mask, and each row carries its own position ids (RoPE sees 0..n-1
for the row's real tokens whatever its padding). New rows are prefilled on their own and merged
into the running batch by left-padding the shorter of the two caches, which is what lets requests
join between decode steps (continuous batching). Padded cache slots hold zeros and are never
attended to, so a row's logits do not depend on what else is in the batch (the tests hold this to
1e-4 against a plain forward pass).

Supports decoder-only models whose every layer has a full (not sliding-window) KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

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
    def __init__(self, model_path: str, dtype: str = "float32", context_length: int | None = None) -> None:
        config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=_DTYPES[dtype], attn_implementation="sdpa"
        ).eval()
        self.config = config
        self.vocab_size = int(config.vocab_size)
        model_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.context_length = min(context_length, model_context) if context_length else model_context
        eos = getattr(self.model.generation_config, "eos_token_id", None) or config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: keys, values (B, H, T, D)
        self._mask = torch.zeros((0, 0), dtype=torch.long)  # (B, T): 1 where the cache holds a real token
        self._next_pos = torch.zeros((0,), dtype=torch.long)  # (B,): position id of each row's next token

    @property
    def rows(self) -> int:
        return int(self._mask.shape[0])

    @torch.inference_mode()
    def add(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        assert prompts and all(prompts), "every prompt needs at least one token"
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)  # (n, L)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (n, L)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (n, L)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._merge(_tensors(out.past_key_values), mask, torch.tensor(lengths, dtype=torch.long))
        return out.logits[:, -1, :].float()  # (n, V)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        assert len(tokens) == self.rows, f"step needs one token per running row ({self.rows}), got {len(tokens)}"
        mask = torch.cat([self._mask, torch.ones((self.rows, 1), dtype=torch.long)], dim=1)  # (B, T+1)
        cache = DynamicCache(ddp_cache_data=self._kv)
        out = self.model(
            input_ids=torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1),  # (B, 1)
            attention_mask=mask,
            position_ids=self._next_pos.unsqueeze(1),  # (B, 1)
            past_key_values=cache,
            use_cache=True,
        )
        self._kv = _tensors(cache)
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
        self._kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self._kv
        ]

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

    def _merge(self, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        if self.rows == 0:
            self._kv, self._mask, self._next_pos = kv, mask, next_pos
            return
        width = max(self._mask.shape[1], mask.shape[1])
        old_kv, old_mask = _left_pad(self._kv, self._mask, width)
        new_kv, new_mask = _left_pad(kv, mask, width)
        self._kv = [
            (torch.cat([ok, nk], dim=0), torch.cat([ov, nv], dim=0))
            for (ok, ov), (nk, nv) in zip(old_kv, new_kv, strict=True)
        ]
        self._mask = torch.cat([old_mask, new_mask], dim=0)
        self._next_pos = torch.cat([self._next_pos, next_pos], dim=0)


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError("rlfleet-engine supports only models whose every layer keeps a full key/value cache")
        out.append((keys, values))
    return out


def _left_pad(
    kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, width: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    extra = width - mask.shape[1]
    if extra == 0:
        return kv, mask
    pad_mask = torch.zeros((mask.shape[0], extra), dtype=mask.dtype)
    padded = []
    for k, v in kv:
        pad = torch.zeros((k.shape[0], k.shape[1], extra, k.shape[3]), dtype=k.dtype)
        padded.append((torch.cat([pad, k], dim=2), torch.cat([pad.to(v.dtype), v], dim=2)))
    return padded, torch.cat([pad_mask, mask], dim=1)
