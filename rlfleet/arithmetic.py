"""The built-in arithmetic task: seeded, procedural problems such as `37+45=` -> `82`.

A problem belongs to the held-out split by a hash of its text alone, so the train and held-out
splits never share a problem, whatever the seed or the sizes asked for.

Problems are drawn at random and the ones of the other split or already drawn are rejected. A small
problem space (1- and 2-digit operands) is counted once per process, so asking one of its splits for
more than it holds is refused without drawing and a request for all of it stops at the last problem,
rather than drawing until a budget of 200 draws per problem asked for runs out (seconds, at 2 digits).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Literal

Split = Literal["train", "test"]
OPERATORS = "+-*/"
# Problem spaces up to this size are counted by enumeration (about 0.1 s at the limit). Every larger one
# (3-digit operands, or 5-digit divisions) holds over a million problems.
COUNTED_SPACE_LIMIT = 100_000


@dataclass(frozen=True)
class Problem:
    prompt: str
    """What the model sees, e.g. `37+45=`."""
    answer: str
    """The exact expected completion, e.g. `82`."""


@dataclass(frozen=True)
class ArithmeticTask:
    digits: int = 2
    """Digits per operand: operands are drawn from [0, 10**digits)."""
    ops: str = "+"
    """Operators to draw from, a subset of `+-*/`; `/` only yields exact integer quotients of at least 1, every
    such problem (dividend below 10**digits) as likely as any other."""
    seed: int = 0
    """Seed of the draw; the same seed gives the same problems in the same order."""
    heldout_per_mille: int = 100
    """Share of all problems (per 1000) reserved for the held-out split."""

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be between 1 and 9, got {self.digits}")
        if not self.ops or any(op not in OPERATORS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {OPERATORS!r}, got {self.ops!r}")
        if not 0 < self.heldout_per_mille < 1000:
            raise ValueError(f"heldout_per_mille must be in (0, 1000), got {self.heldout_per_mille}")

    def problems(self, split: Split, count: int, *, epoch: int = 0) -> list[Problem]:
        """`count` distinct problems of `split`; train problems are drawn anew for each epoch.

        Raises ValueError as `stream` does.
        """
        return list(self.stream(split, count, epoch=epoch))

    def stream(self, split: Split, count: int, *, epoch: int = 0) -> Iterator[Problem]:
        """The problems of `problems`, one at a time as they are drawn, for an export too large to hold.

        Raises ValueError when the split holds fewer than `count` distinct problems (before the first, for a
        counted space), or when its draws find fewer within their budget of 200 per problem asked for (after
        the last one found).
        """
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        size = self.split_size(split)
        if size is not None and count > size:
            raise ValueError(
                f"the {split} split of {self.digits}-digit {self.ops!r} problems holds {size} distinct problems, "
                f"fewer than {count}; ask for fewer or use more digits or operators"
            )
        found = 0
        for problem in self._distinct(split, count, epoch):
            found += 1
            yield problem
        if found < count:
            # Only a split the draw nearly exhausts (each operator is drawn as often: the more problems, the rarer).
            of = f"{found}" if size is None else f"{found} of its {size}"
            raise ValueError(
                f"could not draw {count} distinct problems from the {split} split of {self.digits}-digit "
                f"{self.ops!r} problems (found {of}); ask for fewer or use more digits or operators"
            )

    def train_pool(self, at_most: int) -> list[Problem]:
        """Up to `at_most` distinct train problems (fewer when the split holds fewer), in draw order.

        A run cycles through this pool epoch after epoch instead of being refused when it needs more.
        """
        if at_most < 1:
            raise ValueError(f"at_most must be >= 1, got {at_most}")
        size = self.split_size("train")
        return list(self._distinct("train", at_most if size is None else min(at_most, size), 0))

    def split_size(self, split: Split) -> int | None:
        """How many distinct problems `split` holds, or None for a space too large to count (see above)."""
        sizes = _split_sizes(self.digits, "".join(sorted(set(self.ops))), self.heldout_per_mille)
        if sizes is None:
            return None
        return sizes[1] if split == "test" else sizes[0]

    def _distinct(self, split: Split, count: int, epoch: int) -> Iterator[Problem]:
        """Up to `count` distinct problems of `split` in draw order; fewer when the draw budget runs out."""
        rng = random.Random(f"{self.seed}/{split}/{epoch if split == 'train' else 0}")
        want_heldout = split == "test"
        seen: set[str] = set()
        # Rejection sampling; the bound only trips when the split is (nearly) exhausted.
        for _ in range(max(1000, 200 * count)):
            if len(seen) == count:
                return
            problem = self._draw(rng)
            if problem.prompt in seen or self.is_heldout(problem.prompt) != want_heldout:
                continue
            seen.add(problem.prompt)
            yield problem

    def is_heldout(self, prompt: str) -> bool:
        digest = hashlib.sha256(prompt.encode()).digest()
        return int.from_bytes(digest[:4], "big") % 1000 < self.heldout_per_mille

    def _draw(self, rng: random.Random) -> Problem:
        op = rng.choice(self.ops)
        bound = 10**self.digits
        if op == "/":
            b, q = _division(rng, bound - 1)
            return Problem(f"{b * q}/{b}=", str(q))
        a, b = rng.randrange(bound), rng.randrange(bound)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(f"{a}{op}{b}=", str(result))


@cache
def _split_sizes(digits: int, ops: str, heldout_per_mille: int) -> tuple[int, int] | None:
    """(train, test) problem counts of a space of at most COUNTED_SPACE_LIMIT problems; None for a larger one."""
    bound = 10**digits
    if bound - 1 > COUNTED_SPACE_LIMIT:  # a division alone has a problem per divisor
        return None
    space = sum(_division_count(bound) if op == "/" else bound * bound for op in ops)
    if space > COUNTED_SPACE_LIMIT:
        return None
    task = ArithmeticTask(digits=digits, ops=ops, heldout_per_mille=heldout_per_mille)
    heldout = sum(task.is_heldout(prompt) for prompt in _all_prompts(bound, ops))
    return space - heldout, heldout


def _division(rng: random.Random, top: int) -> tuple[int, int]:
    """A divisor and quotient (b, q >= 1, b * q <= top), every such pair as likely as any other.

    A quotient of 0 would make most problems "0/b="; drawing b and then q in [1, top // b] gave every b above
    top / 2 the quotient 1 alone, so 60% of the problems were "x/x=" (and "x/1=" was rare). Instead a point is
    drawn uniformly from a cover of the pairs, a rectangle per block of divisors [2**k, 2**(k + 1)) holding every
    quotient up to top // 2**k, and drawn again when it is not a pair (b * q > top): fewer than 1 point in 3.
    """
    ends = _division_cover(top)
    while True:
        point = rng.randrange(ends[-1])
        k = bisect.bisect_right(ends, point)
        offset = point - (ends[k - 1] if k else 0)
        height = top >> k
        b, q = (1 << k) + offset // height, 1 + offset % height
        if b * q <= top:
            return b, q


@cache
def _division_cover(top: int) -> tuple[int, ...]:
    """The cumulative sizes of `_division`'s rectangles: divisors [2**k, min(2**(k + 1), top + 1)), quotients
    [1, top >> k]."""
    sizes = [(min(2 << k, top + 1) - (1 << k)) * (top >> k) for k in range(top.bit_length())]
    return tuple(sum(sizes[: k + 1]) for k in range(len(sizes)))


def _division_count(bound: int) -> int:
    return sum((bound - 1) // b for b in range(1, bound))


def _all_prompts(bound: int, ops: str) -> Iterator[str]:
    """Every prompt `ArithmeticTask._draw` can make, once each."""
    for op in ops:
        if op == "/":
            yield from (f"{b * q}/{b}=" for b in range(1, bound) for q in range(1, (bound - 1) // b + 1))
        else:
            yield from (f"{a}{op}{b}=" for a in range(bound) for b in range(bound))
