"""AdamW with linear warmup to a constant learning rate."""

from __future__ import annotations

import torch


def make_optimizer(
    model: torch.nn.Module, learning_rate: float, weight_decay: float, warmup_steps: int, start_step: int = 0
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """`start_step` continues the schedule of a resumed run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.99))

    def factor(step: int) -> float:
        return min(1.0, (start_step + step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
