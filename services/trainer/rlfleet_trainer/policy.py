"""The policy model: loading a Hugging Face causal LM and scoring tokens with it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlfleet_trainer.batch import Batch


def load_policy(path: str | Path) -> PreTrainedModel:
    """fp32 on CPU: the engines compute in fp32 too, so train and rollout log-probs agree to ~1e-6."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config.use_cache = False
    return model


def token_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (B, L-1) of each target token under softmax(logits / temperature), the
    distribution the engine sampled from (plain softmax for greedy, temperature 0), and optionally
    the per-position entropy (B, L-1) of that distribution."""
    positions = (batch.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    logits = logits[:, :-1].float()  # (B, L-1, V): position p predicts token p + 1
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)  # (B, L-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return picked, entropy
