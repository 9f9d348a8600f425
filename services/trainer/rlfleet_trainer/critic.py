"""PPO's critic: a value head on the policy's last hidden state, trained on GAE returns.

The head reads the hidden state with its gradient stopped and has an optimizer of its own, so
the value loss never moves the policy: the policy update is the same whatever the critic's
learning rate. Its weights stay in the trainer (engines serve the policy only).
"""

from __future__ import annotations

import torch


def clipped_value_loss(
    values: torch.Tensor,  # (B, T) current V(s_t)
    old_values: torch.Tensor,  # (B, T) V(s_t) when the advantages were computed
    returns: torch.Tensor,  # (B, T) value targets
    clip: float,
) -> torch.Tensor:
    """PPO's clipped value loss per token:

    V_clip = V_old + clip(V - V_old, -clip, clip)
    l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)
    """
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())  # (B, T)


class Critic:
    """A linear value head (hidden size -> 1), zero-initialised so the first values are 0."""

    def __init__(self, hidden_size: int, learning_rate: float, value_clip: float) -> None:
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=learning_rate, weight_decay=0.0)
        self.value_clip = value_clip

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (B, T, H) -> (B, T) values; no gradient reaches the policy."""
        return self.head(hidden.detach().float()).squeeze(-1)
