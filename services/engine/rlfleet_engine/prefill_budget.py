"""What one prefill of the `transformers` backend costs, and the bound `--max-prefill-tokens` puts on it.

The backend prefills its new rows in one forward pass over the distinct prompts (equal prompts, such as the `n`
samples of one, are computed once and copied), each left-padded to the longest: the pass computes distinct
prompts x the longest prompt tokens, and its attention mask holds that many rows of the longest prompt's width.
So that product is what the budget bounds, not the sum of the prompts' lengths (SGLang's count, whose
batches are not padded): 32 prompts of 4k tokens in one pass take a 512 MB boolean mask besides the activations.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class PrefillBatch:
    """The prompts of one prefill, taken while its cost stays within `budget` tokens."""

    def __init__(self, budget: int) -> None:
        assert budget > 0
        self.budget = budget
        self._distinct: set[tuple[int, ...]] = set()
        self._longest = 0

    @property
    def tokens(self) -> int:
        """What the prefill computes: distinct prompts x the longest, padding included."""
        return len(self._distinct) * self._longest

    def take(self, prompt: Sequence[int]) -> bool:
        """Adds `prompt` if the batch stays within the budget, or is empty: a prompt over the budget is prefilled
        alone, as SGLang runs it. A prompt already in the batch costs nothing more. False, nothing added, if the
        prompt does not fit."""
        key = tuple(prompt)
        if key in self._distinct:
            return True
        longest = max(self._longest, len(key))
        if self._distinct and (len(self._distinct) + 1) * longest > self.budget:
            return False
        self._distinct.add(key)
        self._longest = longest
        return True


def prefill_batches(prompts: Sequence[Sequence[int]], budget: int) -> Iterator[list[Sequence[int]]]:
    """`prompts` in order, cut into consecutive runs that each fit one prefill of `budget` tokens."""
    batch = PrefillBatch(budget)
    run: list[Sequence[int]] = []
    for prompt in prompts:
        if not batch.take(prompt):
            yield run
            batch, run = PrefillBatch(budget), []
            batch.take(prompt)
        run.append(prompt)
    if run:
        yield run
