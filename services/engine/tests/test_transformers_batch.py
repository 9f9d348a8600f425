"""The `transformers` backend's batch without the server: a row's tokens and logits do not depend on what shares
its batch (rows joining while it decodes, rows leaving), a decode step does not copy the KV cache, the `n`
samples of a prompt share one prefill, and every eos id SGLang stops at ends a sequence."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlfleet_engine.kv_buffers import MIN_ROOM
from rlfleet_engine.transformers_backend import TransformersBackend, tokenizer_eos_token_ids

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> Iterator[TransformersBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TransformersBackend(str(tiny_model_dir))
    torch.set_num_threads(threads)


def _alone(backend: TransformersBackend, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits they were chosen from, for `prompt` decoded alone."""
    backend.keep([])
    logits = [backend.add([prompt])[0]]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(backend.step([tokens[-1]])[0])
    backend.keep([])
    return tokens, torch.stack(logits[:-1])


class _Row:
    def __init__(self, prompt: list[int], steps: int) -> None:
        self.prompt, self.steps = prompt, steps
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.steps

    def take(self, logits: torch.Tensor) -> None:
        self.logits.append(logits)
        self.tokens.append(int(logits.argmax()))


def test_a_row_decodes_the_same_whatever_joins_or_leaves_its_batch(backend: TransformersBackend) -> None:
    # Prompts shorter and longer than the running rows' caches join at different steps; rows finish (and leave)
    # at different steps, so the batch is left-padded, merged and trimmed along the way.
    plan = [  # (step it joins at, prompt, tokens it decodes)
        (0, list(range(10, 40)), 90),  # outgrows the room its cache was allocated with
        (0, [5, 6], 8),
        (3, [50, 51, 52], 20),
        (5, [60] * 70, 12),
        (5, [61] * 70, 12),  # joins with another prompt in one prefill
        (9, [7], 15),
        (95, [8, 9, 10], 4),  # joins a batch whose rows have all left
    ]
    assert plan[0][2] > MIN_ROOM  # so the first row's buffers are reallocated on the way
    expected = [_alone(backend, prompt, steps) for _, prompt, steps in plan]
    everyone: list[_Row] = []
    batch: list[_Row] = []  # in the backend's row order
    for step in range(100):
        joining = [_Row(prompt, steps) for start, prompt, steps in plan if start == step]
        if joining:
            for row, logits in zip(joining, backend.add([row.prompt for row in joining]), strict=True):
                row.take(logits)
            batch += joining
            everyone += joining
        backend.keep([i for i, row in enumerate(batch) if not row.done])
        batch = [row for row in batch if not row.done]
        if batch:
            for row, logits in zip(batch, backend.step([row.tokens[-1] for row in batch]), strict=True):
                row.take(logits)
    assert len(everyone) == len(plan) and all(row.done for row in everyone)
    for row, (tokens, logits) in zip(everyone, expected, strict=True):
        assert row.tokens == tokens
        assert (torch.stack(row.logits) - logits).abs().max() < TOLERANCE
    backend.keep([i for i, row in enumerate(batch) if not row.done])
    assert backend.rows == 0


class _NewTensorBytes(TorchDispatchMode):
    """Records the bytes of every tensor the ops under it allocate (not views of their inputs, not written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(tensor.untyped_storage().nbytes())
        return out


def test_a_decode_step_does_not_copy_the_kv_cache(backend: TransformersBackend) -> None:
    backend.keep([])
    prompts = [[9 + i] * 300 for i in range(4)]
    logits = backend.add(prompts)
    layers = backend.model.config.num_hidden_layers
    heads = backend.model.config.num_key_value_heads
    head_dim = backend.model.config.hidden_size // backend.model.config.num_attention_heads
    layer_bytes = len(prompts) * heads * 300 * head_dim * 4  # one layer's keys, float32
    for _ in range(3):
        with _NewTensorBytes() as created:
            logits = backend.step(logits.argmax(dim=-1).tolist())
        # Concatenating the cache (as Hugging Face's DynamicLayer does) created twice every layer's keys and values.
        assert max(created.sizes) < layer_bytes / 4
        assert sum(created.sizes) < layers * 2 * layer_bytes / 4
    backend.keep([])


class _PrefillRows:
    """Records how many rows (and tokens) each forward pass of the model computes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    def remove(self) -> None:
        self._handle.remove()


def test_the_samples_of_a_prompt_share_one_prefill(backend: TransformersBackend) -> None:
    backend.keep([])
    prompt, other = list(range(20, 60)), [3, 4, 5]
    expected_tokens, expected_logits = _alone(backend, prompt, 6)
    counter = _PrefillRows(backend.model)
    try:
        logits = backend.add([prompt, prompt, other, prompt])  # n = 3 of one prompt, sent with another
    finally:
        counter.remove()
    assert counter.shapes == [(2, len(prompt))]  # two distinct prompts computed, not four
    assert backend.rows == 4
    rows = [[int(row.argmax())] for row in logits]
    seen = [[row] for row in logits]
    for _ in range(5):
        logits = backend.step([tokens[-1] for tokens in rows])
        for tokens, got, row in zip(rows, seen, logits, strict=True):
            tokens.append(int(row.argmax()))
            got.append(row)
    for k in (0, 1, 3):
        assert rows[k] == expected_tokens
        assert (torch.stack(seen[k]) - expected_logits).abs().max() < TOLERANCE
    assert rows[2] == _alone(backend, other, 6)[0]


def _model_with_eos(src: Path, dst: Path, config_eos: Any, generation_eos: Any) -> Path:
    shutil.copytree(src, dst)
    for name, eos in (("config.json", config_eos), ("generation_config.json", generation_eos)):
        data = json.loads((dst / name).read_text())
        data["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(data))
    return dst


def test_the_eos_ids_of_the_config_and_the_generation_config_both_end_a_sequence(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A fine-tuned checkpoint often names its chat end token in config.json only; SGLang stops at the union.
    model = _model_with_eos(tiny_model_dir, tmp_path / "m", config_eos=7, generation_eos=[1, 2])
    assert TransformersBackend(str(model)).eos_token_ids == {1, 2, 7}
    assert TransformersBackend(str(model), tokenizer_eos_token_ids=[9]).eos_token_ids == {1, 2, 7, 9}


def test_the_tokenizer_ends_sequences_with_its_eos_and_llama3_eom() -> None:
    class Tokenizer:
        eos_token_id = 4

        def get_added_vocab(self) -> dict[str, int]:
            return {"<|eom_id|>": 11, "<|other|>": 12}

    assert tokenizer_eos_token_ids(Tokenizer()) == [4, 11]
    assert tokenizer_eos_token_ids(object()) == []
