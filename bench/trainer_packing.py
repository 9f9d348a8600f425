"""Trainer throughput with packed micro-batches against padded ones, on a batch of skewed lengths.

Both layouts run the same forward and backward (the policy's log-probs of every response token,
summed) on the same sequences under the same token budget per micro-batch:
- padded: one sequence per row, rows padded to the micro-batch's longest, in arrival order (what
  a trainer without packing does); also reported sorted by length, the best a padded layout gets;
- packed: sequences concatenated into rows (first-fit decreasing, block-diagonal attention),
  rows of about the same length per micro-batch (rlfleet_trainer.batch.plan_micro_batches).
Throughput counts real tokens only. Run:

    .venv/bin/python bench/trainer_packing.py [--sequences 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from rlfleet.tiny_model import TinyModelConfig, create_tiny_model
from rlfleet_trainer.batch import TrainSequence, pack, plan_micro_batches
from rlfleet_trainer.policy import load_policy, token_logprobs

PROMPT_TOKENS = 16


def skewed_batch(count: int, seed: int) -> list[TrainSequence]:
    """Most responses short, one in eight long: RL batches where a few answers run to the limit."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        response = rng.randint(160, 240) if rng.random() < 0.125 else rng.randint(8, 40)
        tokens = tuple(rng.randint(3, 30) for _ in range(PROMPT_TOKENS + response))
        out.append(
            TrainSequence(tokens=tokens, prompt_len=PROMPT_TOKENS, old_logp=(0.0,) * response, mask=(1,) * response)
        )
    return out


def padded_plan(lengths: Sequence[int], order: Sequence[int], token_budget: int) -> list[list[list[int]]]:
    """One sequence per row, taken in `order`, rows x longest row within the budget."""
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    longest = 0
    for i in order:
        if current and (len(current) + 1) * max(longest, lengths[i]) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append([i])
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    return batches


def run(model: torch.nn.Module, sequences: list[TrainSequence], plan: list[list[list[int]]]) -> tuple[float, float]:
    """Forward + backward over every micro-batch; returns (seconds, summed log-prob)."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    total = 0.0
    for rows in plan:
        batch = pack(sequences, rows, pad_id=0)
        logp = token_logprobs(model, batch, temperature=1.0).logp
        loss = -(logp * batch.mask).sum()
        loss.backward()
        total += float(loss.detach())
    return time.perf_counter() - started, total


def slots(sequences: list[TrainSequence], plan: list[list[list[int]]]) -> int:
    return sum(len(rows) * max(sum(len(sequences[i].tokens) for i in row) for row in rows) for rows in plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for flag in ("sequences", "token_budget", "repeats", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        params = create_tiny_model(Path(tmp) / "model", TinyModelConfig())
        model = load_policy(Path(tmp) / "model")
    sequences = skewed_batch(args.sequences, seed=0)
    lengths = [len(s.tokens) for s in sequences]
    tokens = sum(lengths)
    arrival = list(range(len(sequences)))
    plans = {
        "padded (arrival order)": padded_plan(lengths, arrival, args.token_budget),
        "padded (sorted by length)": padded_plan(lengths, sorted(arrival, key=lambda i: lengths[i]), args.token_budget),
        "packed": plan_micro_batches(lengths, args.token_budget),
    }
    print(
        f"tiny model ({params / 1e6:.1f}M parameters), {len(sequences)} sequences, {tokens} tokens "
        f"(lengths {min(lengths)}..{max(lengths)}), token budget {args.token_budget}, {args.threads} threads"
    )
    sums = {name: run(model, sequences, plan)[1] for name, plan in plans.items()}  # also warms up every shape
    best = dict.fromkeys(plans, float("inf"))
    for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits every layout alike
        for name, plan in plans.items():
            best[name] = min(best[name], run(model, sequences, plan)[0])
    rates = {name: tokens / seconds for name, seconds in best.items()}
    for name, plan in plans.items():
        print(
            f"{name:28s} {len(plan):3d} micro-batches, {tokens / slots(sequences, plan):6.1%} of slots real, "
            f"{best[name]:6.2f} s, {rates[name]:8.0f} tokens/s"
        )
    spread = (max(sums.values()) - min(sums.values())) / abs(sums["packed"])
    print(f"summed log-prob agrees across layouts to a relative {spread:.1e}")
    print(f"packed / padded (arrival order): {rates['packed'] / rates['padded (arrival order)']:.2f}x")
    print(f"packed / padded (sorted by length): {rates['packed'] / rates['padded (sorted by length)']:.2f}x")


if __name__ == "__main__":
    main()
