"""`rlfleet model init`: write the tiny model and tokenizer every local run trains on."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfleet.tiny_model import TinyModelConfig, create_tiny_model


def register(areas: argparse._SubParsersAction) -> None:
    parser = areas.add_parser("model", help="create models")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{init}")
    init = commands.add_parser(
        "init",
        help="write a tiny random-init Llama causal LM and a character tokenizer (Hugging Face format)",
    )
    defaults = TinyModelConfig()
    init.add_argument("--out", type=Path, required=True, help="directory to create (new or empty)")
    init.add_argument("--hidden-size", type=int, default=defaults.hidden_size, help="width of the residual stream")
    init.add_argument("--layers", type=int, default=defaults.layers, help="transformer blocks")
    init.add_argument("--heads", type=int, default=defaults.heads, help="attention heads; must divide the hidden size")
    init.add_argument(
        "--kv-heads",
        type=int,
        default=defaults.kv_heads,
        help="key/value heads (grouped-query attention); must divide the heads",
    )
    init.add_argument(
        "--intermediate-size", type=int, default=defaults.intermediate_size, help="width of each block's MLP"
    )
    init.add_argument("--max-positions", type=int, default=defaults.max_positions, help="context length in tokens")
    init.add_argument("--seed", type=int, default=defaults.seed, help="seed of the random initialisation")
    init.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    config = TinyModelConfig(
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        max_positions=args.max_positions,
        seed=args.seed,
    )
    config.validate()
    try:
        params = create_tiny_model(args.out, config)
    except ImportError as exc:
        hint = "creating a model needs torch and transformers: pip install 'rlfleet[model]'"
        raise ValueError(f"{hint} ({exc})") from exc
    print(f"wrote a {params / 1e6:.1f}M-parameter model and tokenizer to {args.out}")
    return 0
