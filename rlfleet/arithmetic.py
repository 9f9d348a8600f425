"""The built-in arithmetic task: seeded, procedural problems such as `37+45=` -> `82`.

A problem belongs to the held-out split by a hash of its text alone, so the train and held-out
splits never share a problem, whatever the seed or the sizes asked for.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "test"]
OPERATORS = "+-*/"


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
    """Operators to draw from, a subset of `+-*/`; `/` only yields exact integer quotients."""
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

        Raises ValueError when the split holds fewer than `count` distinct problems.
        """
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        out = self._collect(split, count, epoch)
        if len(out) < count:
            raise ValueError(
                f"the {split} split of {self.digits}-digit {self.ops!r} problems holds fewer than {count} "
                f"distinct problems (found {len(out)}); ask for fewer or use more digits or operators"
            )
        return out

    def train_pool(self, at_most: int) -> list[Problem]:
        """Up to `at_most` distinct train problems (fewer when the split holds fewer), in draw order.

        A run cycles through this pool epoch after epoch instead of being refused when it needs more.
        """
        if at_most < 1:
            raise ValueError(f"at_most must be >= 1, got {at_most}")
        return self._collect("train", at_most, 0)

    def _collect(self, split: Split, count: int, epoch: int) -> list[Problem]:
        rng = random.Random(f"{self.seed}/{split}/{epoch if split == 'train' else 0}")
        want_heldout = split == "test"
        seen: set[str] = set()
        out: list[Problem] = []
        # Rejection sampling; the bound only trips when the split is (nearly) exhausted.
        for _ in range(max(1000, 200 * count)):
            if len(out) == count:
                break
            problem = self._draw(rng)
            if problem.prompt in seen or self.is_heldout(problem.prompt) != want_heldout:
                continue
            seen.add(problem.prompt)
            out.append(problem)
        return out

    def is_heldout(self, prompt: str) -> bool:
        digest = hashlib.sha256(prompt.encode()).digest()
        return int.from_bytes(digest[:4], "big") % 1000 < self.heldout_per_mille

    def _draw(self, rng: random.Random) -> Problem:
        op = rng.choice(self.ops)
        bound = 10**self.digits
        if op == "/":
            b = rng.randrange(1, bound)
            q = rng.randrange(0, bound // b if bound // b > 0 else 1)
            a = b * q
            return Problem(f"{a}/{b}=", str(q))
        a, b = rng.randrange(bound), rng.randrange(bound)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(f"{a}{op}{b}=", str(result))
