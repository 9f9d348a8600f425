"""The policy model: loading a Hugging Face causal LM and scoring packed tokens with it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from rlfleet_trainer.batch import PackedBatch

POLICY_DTYPE = torch.float32
"""The engines compute in fp32 too, so train and rollout log-probs agree to ~1e-6."""


def load_policy(path: str | Path) -> PreTrainedModel:
    """The model at `path`, in POLICY_DTYPE on the CPU."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=POLICY_DTYPE)
    model.config.use_cache = False
    return model


def policy_skeleton(path: str | Path) -> PreTrainedModel:
    """The model at `path` as load_policy builds it (class, config, dtype, eval mode, tied parameters), with every
    parameter and buffer on the meta device: its config is read, its weights are not. Sharded, then materialised
    and loaded by `sharding.load_from_rank_0`, it takes a rank its shard of memory instead of a whole copy."""
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=POLICY_DTYPE)
    model.config.use_cache = False
    model.eval()  # from_pretrained's mode
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """RL trains without dropout, as the engines sample without it: with it, the trainer's log-probs of on-policy
    tokens differ from the rollout's and from the reference's by noise (ratios off 1, a KL above 0 at step 0).
    Covers dropout modules (GPT-2's attn/resid/embd_pdrop) and the float handed to attention kernels (Llama's and
    Qwen's attention_dropout, 0 in their configs already). The model's config, exported with its weights, is kept."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # noqa: B010 - a plain attribute torch's typing does not know


@dataclass(frozen=True)
class ScoredTokens:
    logp: torch.Tensor  # (B, T) log-probability of each response token
    entropy: torch.Tensor | None  # (B, T) entropy of the distribution each token was drawn from
    hidden: torch.Tensor | None  # (B, T, H) last hidden state at the position predicting each token


def token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    with_entropy: bool = False,
    with_hidden: bool = False,
) -> ScoredTokens:
    """Scores the response tokens of a packed batch under softmax(logits / temperature), the
    distribution the engine sampled from (plain softmax for greedy, temperature 0). Only the
    positions that predict response tokens go through the softmax.

    The model may live on a GPU (sharded); the batch and the results stay on the CPU, where the
    step's small (B, T) grids are."""
    device = next(model.parameters()).device
    index = batch.index.to(device)
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        output_hidden_states=with_hidden,
    )
    logits = out.logits.flatten(0, 1)[index].float()  # (B, T, V)
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = batch.targets.to(device).flatten()[index]  # (B, T)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    hidden = out.hidden_states[-1].flatten(0, 1)[index] if with_hidden else None
    home = batch.index.device
    return ScoredTokens(
        logp=picked.to(home),
        entropy=entropy.to(home) if entropy is not None else None,
        hidden=hidden.to(home) if hidden is not None else None,
    )
