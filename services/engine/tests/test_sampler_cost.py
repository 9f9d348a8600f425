"""What the sampler sorts: a large vocabulary is sorted only for a row whose top-p needs it, so a decode step of a
real vocabulary (152k tokens) does not spend longer sampling than computing its logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlfleet_engine.sampler import TOP_P_DEPTH, sample
from rlfleet_engine.sampling_params import SamplingParams

VOCAB = 8 * TOP_P_DEPTH


class _SortDepths(TorchFunctionMode):
    """Records how many entries of each row every sort or top-k under it ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.depths: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("sort", "argsort"):
            self.depths.append(args[0].shape[-1])
        elif name == "topk":
            self.depths.append(int(args[1] if len(args) > 1 else kwargs["k"]))
        return func(*args, **kwargs)


def _depths(params: SamplingParams, logits: torch.Tensor) -> list[int]:
    with _SortDepths() as seen:
        sample(logits, [params] * logits.shape[0], generator=torch.Generator().manual_seed(0))
    return seen.depths


FLAT = torch.zeros(4, VOCAB)
PEAKED = torch.cat([torch.full((4, 1), 20.0), torch.zeros(4, VOCAB - 1)], dim=1)


@pytest.mark.parametrize(
    ("params", "logits", "deepest"),
    [
        (SamplingParams(), FLAT, 0),  # nothing to truncate: nothing sorted
        (SamplingParams(min_p=0.1), FLAT, 0),  # a fraction of the top probability needs no order
        (SamplingParams(top_k=50, top_p=0.9), FLAT, 50),  # the 50 most likely only
        (SamplingParams(top_p=0.9), PEAKED, TOP_P_DEPTH),  # the head holds p of the mass: the rest is out
        (SamplingParams(top_p=0.9), FLAT, VOCAB),  # a flat distribution needs the whole order
    ],
)
def test_the_sampler_ranks_only_what_a_row_truncates(
    params: SamplingParams, logits: torch.Tensor, deepest: int
) -> None:
    assert max(_depths(params, logits), default=0) == deepest


def test_a_greedy_batch_sorts_nothing() -> None:
    assert _depths(SamplingParams(temperature=0.0), FLAT) == []


def _reference(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p over the whole sorted vocabulary, as SGLang's torch sampler applies them."""
    out = torch.zeros_like(probs)
    for i, p in enumerate(params):
        sorted_probs, order = probs[i].sort(descending=True)
        rank = torch.arange(probs.shape[1])
        k = p.top_k if p.top_k > 0 else probs.shape[1]
        drop = (rank >= k) | (sorted_probs < sorted_probs[0] * p.min_p)
        if p.top_p < 1.0:  # (a top-p of 1 drops nothing, whatever the rounding of the cumulative sum)
            drop |= sorted_probs.cumsum(0) - sorted_probs > p.top_p
        drop[0] = False
        out[i, order] = sorted_probs.masked_fill(drop, 0.0)
    return out


def test_ranking_less_keeps_the_same_tokens() -> None:
    from rlfleet_engine.sampler import truncated_probs

    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        scale = (0.1, 1.0, 8.0)[trial % 3]
        probs = torch.softmax(torch.randn(6, VOCAB, generator=generator) * scale, dim=-1)
        params = [
            SamplingParams(top_k=k, top_p=p, min_p=m)
            for k, p, m in zip(
                (-1, 3, 2000, -1, -1, 40), (0.9, 1.0, 0.5, 1.0, 0.3, 0.95), (0.0, 0.0, 0.1, 0.2, 0.0, 0.0), strict=True
            )
        ]
        assert torch.equal(truncated_probs(probs, params, VOCAB), _reference(probs, params))
