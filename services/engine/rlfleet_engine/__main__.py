"""`python -m rlfleet_engine --model-path DIR --port 30001`: load the model, start the scheduler, serve HTTP.

The command line is parsed before torch or transformers are imported, so `--help` and flag
mistakes answer at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from rlfleet.logs import init_logging
from rlfleet_engine.config import EngineConfig, config_from_args

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    init_logging("engine", config.log_level)
    if config.backend == "sglang":
        from rlfleet_engine.sglang_backend import exec_sglang

        exec_sglang(config)
    if config.backend == "sim":
        from rlfleet_engine.sim_backend import serve_sim

        return serve_sim(config)
    serve(config)


def serve(config: EngineConfig) -> None:
    import torch
    from prometheus_client import CollectorRegistry
    from transformers import AutoTokenizer

    from rlfleet_engine.engine_core import EngineCore, Tokenizer
    from rlfleet_engine.generation_defaults import read_chat_sampling_defaults
    from rlfleet_engine.http_app import create_app
    from rlfleet_engine.serving import serve_http
    from rlfleet_engine.transformers_backend import TransformersBackend, tokenizer_eos_token_ids

    # Read before the model loads, so a bad file stops the engine at once.
    chat_defaults = read_chat_sampling_defaults(config.model_path)
    if chat_defaults:
        logger.info("chat requests default to the model's generation_config.json sampling values: %s", chat_defaults)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    logger.info("loading %s (%s, %d torch threads)", config.model_path, config.dtype, torch.get_num_threads())
    # Hugging Face tokenizers have the encode/decode the core needs, under wider signatures.
    tokenizer = cast(Tokenizer, AutoTokenizer.from_pretrained(config.tokenizer_path))
    backend = TransformersBackend(
        config.model_path,
        dtype=config.dtype,
        context_length=config.context_length,
        tokenizer_eos_token_ids=tokenizer_eos_token_ids(tokenizer),
    )
    registry = CollectorRegistry()
    core = EngineCore(config, backend, tokenizer, registry)
    app = create_app(core, registry, chat_defaults)
    core.start()
    try:
        serve_http(app, config, lambda: core.abort("", abort_all=True))
    finally:
        core.stop()


if __name__ == "__main__":
    main()
