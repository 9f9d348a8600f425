"""Next-token sampling for a batch of rows, each with its own temperature, top-p, top-k, min-p and
(optionally) `sampling_seed`: a seeded row draws from its job's own generator (`seeded_generator`), so
its tokens do not depend on which other requests share the batch.

Logprob convention (the same as SGLang's default, i.e. without SGLANG_RETURN_ORIGINAL_LOGPROB):
the reported logprob of a token is its log-probability under the temperature-scaled distribution
it was drawn from, *before* top-p / top-k / min-p truncation and renormalisation:

    greedy (temperature == 0):   logprob = log_softmax(logits)[token]
    sampled (temperature  > 0):  logprob = log_softmax(logits / temperature)[token]

so a trainer recomputing log_softmax(logits / T) over the full vocabulary gets the same number.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlfleet_engine.sampling_params import SamplingParams

TOP_P_DEPTH = 1024
"""How many of the most likely tokens a top-p without a top-k sorts first (see `truncated_probs`)."""


@dataclass(frozen=True)
class SampledTokens:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[float]
    """Log-probability of each sampled token (see the module docstring)."""
    top_logprobs: list[list[tuple[float, int]]]
    """Per row, the `top_logprobs_num` most likely (logprob, token) pairs of the same distribution."""


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generator: torch.Generator | None = None,
    top_logprobs_nums: Sequence[int] | None = None,
    row_generators: Sequence[torch.Generator | None] | None = None,
) -> SampledTokens:
    """Samples one token per row of `logits` (B, V) under that row's parameters, from the row's own generator
    where `row_generators` gives one (a seeded job), else from the shared `generator`."""
    assert logits.dim() == 2 and logits.shape[0] == len(params), "one row of logits per SamplingParams"
    logits = logits.float()
    rows, vocab = logits.shape
    greedy = torch.tensor([p.is_greedy for p in params], dtype=torch.bool)
    # Greedy rows use temperature 1 so their logprobs are log_softmax(logits), as SGLang does. A temperature past
    # float32's range would be inf, turning a masked (-inf) logit into NaN; the largest float32 flattens as well.
    temperatures = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params]).unsqueeze(1)  # (B, 1)
    temperatures = temperatures.clamp(max=torch.finfo(torch.float32).max)
    logprobs = torch.log_softmax(logits / temperatures, dim=-1)  # (B, V)

    chosen = torch.argmax(logprobs, dim=-1)  # (B,)
    sampled_rows = (~greedy).nonzero().flatten()
    if sampled_rows.numel() > 0:
        sub = [params[i] for i in sampled_rows.tolist()]
        probs = truncated_probs(logprobs[sampled_rows].exp(), sub, vocab)  # (S, V)
        own = [row_generators[i] if row_generators else None for i in sampled_rows.tolist()]
        shared = [k for k, g in enumerate(own) if g is None]
        if shared:
            draws = torch.multinomial(probs[shared], num_samples=1, generator=generator).flatten()
            chosen[sampled_rows[shared]] = draws
        for k, row_generator in enumerate(own):
            if row_generator is not None:  # a seeded job draws from its own generator, whatever its batch
                chosen[sampled_rows[k]] = torch.multinomial(probs[k], num_samples=1, generator=row_generator)[0]

    token_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).flatten()
    tops: list[list[tuple[float, int]]] = [[] for _ in range(rows)]
    nums = list(top_logprobs_nums) if top_logprobs_nums is not None else [0] * rows
    k_max = min(max(nums, default=0), vocab)
    if k_max > 0:
        values, indices = logprobs.topk(k_max, dim=-1)
        for i, k in enumerate(nums):
            tops[i] = list(zip(values[i, :k].tolist(), indices[i, :k].tolist(), strict=True))
    return SampledTokens(token_ids=chosen.tolist(), logprobs=token_logprobs.tolist(), top_logprobs=tops)


def seeded_generator(seed: int | None, sample_index: int) -> torch.Generator | None:
    """The generator of sample `sample_index` (of n) of a prompt sampled with `sampling_seed` = `seed`; None
    without a seed (the row draws from the engine's generator).

    Each sample gets its own stream, a function of (seed, sample_index) alone: samples sharing one
    generator would draw in whatever order the scheduler happened to admit them. The first sample's is
    seeded with `seed` itself, so a request of one sample draws what a seeded request always drew.
    """
    if seed is None:
        return None
    if sample_index == 0:
        return torch.Generator().manual_seed(seed)
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def truncated_probs(probs: torch.Tensor, params: Sequence[SamplingParams], vocab: int) -> torch.Tensor:
    """Zeroes what top-k, top-p and min-p exclude in `probs` (B, V); the most likely token always stays.

    Only what a row needs is sorted (sorting a 152k vocabulary for 16 rows takes ~160 ms of one core, longer
    than a small model's decode step): nothing for a row that truncates nothing or only by min-p (a fraction of
    the most likely token's probability), its k most likely tokens for a row with a top-k, and for a top-p alone
    the TOP_P_DEPTH most likely when they hold over p of the mass (all the others are then dropped), else all."""
    top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    keep = probs >= probs.amax(dim=-1, keepdim=True) * torch.tensor([[p.min_p] for p in params])  # (B, V)
    by_k = [i for i, k in enumerate(top_ks) if k < vocab]
    by_p = [i for i, p in enumerate(params) if top_ks[i] == vocab and p.top_p < 1.0]
    if by_p and TOP_P_DEPTH < vocab:
        head = probs[by_p].topk(TOP_P_DEPTH, dim=-1).values.sum(dim=-1)  # (P,)
        shallow = [i for i, mass in zip(by_p, head.tolist(), strict=True) if mass > params[i].top_p]
        by_p = [i for i in by_p if i not in shallow]
        for i in shallow:
            top_ks[i] = TOP_P_DEPTH
        by_k += shallow
    for rows in (by_k, by_p):
        if rows:
            keep[rows] &= _top_k_top_p(probs[rows], [top_ks[i] for i in rows], [params[i].top_p for i in rows])
    return probs.masked_fill(~keep, 0.0)


def _top_k_top_p(probs: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Which tokens (R, V) top-k and top-p keep: those among the k most likely whose strictly more likely tokens
    hold at most p of the mass, the most likely always."""
    depth = max(top_ks)
    sorted_probs, order = probs.topk(depth, dim=-1)  # (R, depth), most likely first
    rank = torch.arange(depth).unsqueeze(0)  # (1, depth)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (R, depth): mass of strictly more likely tokens
    kept = (rank < torch.tensor(top_ks).unsqueeze(1)) & (mass_before <= torch.tensor(top_ps).unsqueeze(1))
    kept[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, kept)
