"""A run's policy trains without dropout, as the engines sample without it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlfleet_trainer.rank_ops import ShardingOptions, load_model


def test_a_run_scores_the_same_tokens_alike_whatever_the_models_dropout(tmp_path: Path) -> None:
    """GPT-2-style configs carry dropout 0.1: on, the pre-update pass of on-policy tokens gave log-probs off the
    engines' (and each pass off the one before), so ratios started away from 1 and the KL to the reference above 0."""
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.5
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, ShardingOptions(), trainable=True).train()
    tokens = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        first, second = model(tokens).logits, model(tokens).logits
        reference = load_model(tmp_path, ShardingOptions(), trainable=False)(tokens).logits
    assert torch.equal(first, second)
    assert torch.allclose(first, reference, atol=1e-6)
    # The model exported for the engines keeps its config.
    assert json.loads((tmp_path / "config.json").read_text())["resid_pdrop"] == 0.5
    assert model.config.resid_pdrop == 0.5
