"""A step's rollout batch split into PPO mini-batches: one optimizer update each, every epoch.

Every rank holds the whole batch, so every rank computes the same split from the same inputs. Each
epoch deals the batch's groups, in an order shuffled from the run's seed, the step and the epoch,
into `parts` mini-batches of nearly equal numbers of groups:

- shuffled, because groups reach the stream in the order they finish (short answers first), and a
  mini-batch of only the fastest groups would give one update the short answers and the next the long
  ones; a new order every epoch gives each epoch's updates other neighbours, as OpenRLHF's shuffled
  loader does. The seed makes the split the same on every rank and when a resumed run retrains the step;
- by group, because a group's responses are what its advantages compare: kept together, every update
  sees a prompt's better and worse answers side by side (verl counts its mini-batches in prompts too).
  With fewer groups than mini-batches the sequences are dealt one by one instead.

One part is the whole batch in stream order, so a step of one update computes what it always did.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def mini_batch_parts(groups: Sequence[int], parts: int, seed: int, step: int, epoch: int) -> list[list[int]]:
    """groups: the group of each of the step's sequences (TrainSequence.group) -> min(parts, sequences)
    lists of sequence indices, each ascending, together holding every sequence once."""
    assert parts >= 1, "a pass over the batch needs at least one mini-batch"
    count = len(groups)
    if parts == 1 or count <= 1:
        return [list(range(count))] if count else []
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    units = list(members.values()) if len(members) >= parts else [[i] for i in range(count)]
    random.Random(f"rlfleet-mini-batches:{seed}:{step}:{epoch}").shuffle(units)
    parts = min(parts, len(units))
    size, extra = divmod(len(units), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(sorted(i for unit in units[start:end] for i in unit))
        start = end
    return out
