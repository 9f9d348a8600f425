"""`rlfleet data arithmetic`: print problems of the built-in arithmetic task as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys

from rlfleet.arithmetic import ArithmeticTask


def register(areas: argparse._SubParsersAction) -> None:
    parser = areas.add_parser("data", help="inspect and export datasets")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{arithmetic}")
    arith = commands.add_parser(
        "arithmetic", help="write problems of the arithmetic task as JSONL ({prompt, answer}) to stdout"
    )
    arith.add_argument("--split", choices=("train", "test"), default="train", help="train, or the held-out test split")
    arith.add_argument("--count", type=int, default=10, help="problems to write")
    arith.add_argument("--digits", type=int, default=2, help="digits per operand (1-9)")
    arith.add_argument(
        "--ops", default="+", help="operators to draw from, a subset of +-*/ (--ops=-+ when - comes first)"
    )
    arith.add_argument("--seed", type=int, default=0, help="seed of the draw")
    arith.set_defaults(func=run_arithmetic)


def run_arithmetic(args: argparse.Namespace) -> int:
    task = ArithmeticTask(digits=args.digits, ops=args.ops, seed=args.seed)
    for problem in task.stream(args.split, args.count):
        sys.stdout.write(json.dumps({"prompt": problem.prompt, "answer": problem.answer}) + "\n")
    return 0
