"""A policy trained one step and its checkpoint, for the tests of the Hugging Face export."""

from __future__ import annotations

from pathlib import Path

import torch

from rlfleet.tiny_model import TinyModelConfig
from rlfleet_trainer.checkpoint import CheckpointMeta, TrainingState, save_checkpoint
from rlfleet_trainer.policy import load_policy

SMALL = TinyModelConfig(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128)


def trained_checkpoint(model_dir: Path, root: Path) -> tuple[torch.nn.Module, Path]:
    """The policy of `model_dir` after one AdamW step on random tokens, and its checkpoint under `root`."""
    torch.manual_seed(0)
    model = load_policy(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    ids = torch.randint(3, 40, (2, 10))  # (B, T)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, save_checkpoint(root, TrainingState(model, optimizer, schedule), CheckpointMeta(step=1))
