"""The running batch's key/value cache, one `GrowingLayer` per model layer, in buffers with room to grow.

A decode step writes its token's keys and values into the room the buffers keep past the tokens they hold, and
attention reads views of the buffers: a step costs what attention reads, not a copy of the whole cache
(Hugging Face's `DynamicLayer` concatenates at every step, so a step copied every layer's cache, and building a
`DynamicCache` from tensors copied it once more). Buffers are reallocated only when the room runs out, with room
for a quarter more (at least MIN_ROOM tokens), so copies are rare; rows joining or leaving the batch build new
buffers, as they always rebuilt the cache.

Slots that are padding in a row hold zeros (masked out, and finite, so a zero attention weight never meets NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 64
"""Fewest free token slots a buffer is (re)allocated with."""


def _room(length: int) -> int:
    return max(MIN_ROOM, length // 4)


class GrowingLayer(DynamicLayer):
    """One layer's cache: `keys` and `values` (B, H, T, D) are views of buffers (B, H, T + room, D)."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        super().__init__()
        assert key_buffer.shape == value_buffer.shape and length <= key_buffer.shape[2]
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self.is_initialized = True
        self._key_buffer = key_buffer
        self._value_buffer = value_buffer
        self._length = length
        self._expose()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new tokens' keys and values (B, H, q, D) in place; returns the whole cache (B, H, T + q, D)."""
        end = self._length + key_states.shape[2]
        if end > self._key_buffer.shape[2]:
            self._key_buffer = _regrow(self._key_buffer, self._length, end)
            self._value_buffer = _regrow(self._value_buffer, self._length, end)
        self._key_buffer[:, :, self._length : end].copy_(key_states)
        self._value_buffer[:, :, self._length : end].copy_(value_states)
        self._length = end
        self._expose()
        return self.cached()

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, T, D) of the tokens held."""
        return self._key_buffer[:, :, : self._length], self._value_buffer[:, :, : self._length]

    def _expose(self) -> None:
        self.keys, self.values = self.cached()


def _regrow(buffer: torch.Tensor, length: int, needed: int) -> torch.Tensor:
    rows, heads, _, dim = buffer.shape
    grown = buffer.new_empty((rows, heads, needed + _room(needed), dim))
    grown[:, :, :length].copy_(buffer[:, :, :length])
    return grown


def _empty_like_rows(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return like.new_zeros((rows, like.shape[1], width + _room(width), like.shape[3]))


def merged(parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> list[GrowingLayer]:
    """One cache holding the rows of every part, in order; each part is a list of (keys, values) per layer,
    (B_i, H, T_i, D), right-aligned to the widest part (left padding of zeros)."""
    width = max(part[0][0].shape[2] for part in parts)
    rows = sum(part[0][0].shape[0] for part in parts)
    layers = []
    for layer in range(len(parts[0])):
        keys = _empty_like_rows(parts[0][layer][0], rows, width)
        values = _empty_like_rows(parts[0][layer][1], rows, width)
        start = 0
        for part in parts:
            part_keys, part_values = part[layer]
            end = start + part_keys.shape[0]
            keys[start:end, :, width - part_keys.shape[2] : width].copy_(part_keys)
            values[start:end, :, width - part_values.shape[2] : width].copy_(part_values)
            start = end
        layers.append(GrowingLayer(keys, values, width))
    return layers


def selected(layers: Sequence[GrowingLayer], rows: torch.Tensor, start: int) -> list[GrowingLayer]:
    """A new cache of `rows` (indices) of `layers`, without the first `start` token slots; the old buffers are
    let go, so finished rows' memory is freed."""
    parts = []
    for layer in layers:
        keys, values = layer.cached()
        parts.append((keys[:, :, start:].index_select(0, rows), values[:, :, start:].index_select(0, rows)))
    return merged([parts])
