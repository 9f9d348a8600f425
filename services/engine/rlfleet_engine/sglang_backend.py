"""The `sglang` backend: this engine process becomes the real SGLang server (GPU machines).

`python -m rlfleet_engine --backend sglang --model-path DIR --port 30001` replaces itself with
`python -m sglang.launch_server` given the same settings under SGLang's flag names, so the pid a
launcher started (and signals) is SGLang's own, and the router sees the HTTP API it expects.
Metrics are always enabled: the Grafana dashboards read SGLang's `sglang:*` series, which the CPU
engine exports under the same names.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from rlfleet.processes import command_line
from rlfleet_engine.config import EngineConfig

INSTALL_HINT = "pip install 'rlfleet-engine[sglang]'"
"""What to run when SGLang is missing (the engine package's optional `sglang` extra)."""


def sglang_argv(config: EngineConfig, python: str = sys.executable) -> list[str]:
    """The `sglang.launch_server` command line that serves what `config` describes."""
    # _fill_defaults always sets these two; unset, they would reach SGLang as the word None.
    assert config.tokenizer_path is not None and config.served_model_name is not None
    # The CPU engine's defaults of these fit a CPU (16 sequences, float32, seed 0): SGLang sizes its batch from the
    # KV pool, runs the checkpoint's dtype and seeds each server at random, so they reach it only when set.
    chosen = {
        name: getattr(config, name)
        for name in ("max_running_requests", "random_seed", "dtype", "context_length")
        if name in config.model_fields_set and getattr(config, name) is not None
    }
    argv = command_line(
        python,
        "-m",
        "sglang.launch_server",
        model_path=config.model_path,
        tokenizer_path=config.tokenizer_path,
        host=config.host,
        port=config.port,
        served_model_name=config.served_model_name,
        log_level=config.log_level.lower(),
        weight_version=config.weight_version,
        **chosen,
    )
    switches = [
        f"--{name.replace('_', '-')}" for name in ("trust_remote_code", "skip_server_warmup") if getattr(config, name)
    ]
    return [*argv, *switches, "--enable-metrics"]


def sglang_env(config: EngineConfig, base: Mapping[str, str]) -> dict[str, str]:
    """`base` plus the settings SGLang reads from the environment rather than flags."""
    # SGLang bounds /health_generate by this variable, in whole seconds.
    return {**base, "SGLANG_HEALTH_CHECK_TIMEOUT": str(math.ceil(config.health_check_timeout_s))}


def require_sglang() -> None:
    """Exits with the command that installs SGLang when it is not importable here."""
    if importlib.util.find_spec("sglang") is None:
        sys.exit(
            "rlfleet-engine: --backend sglang runs the real SGLang server, which is not installed in "
            f"this environment ({sys.executable}); install it with {INSTALL_HINT} (needs a GPU machine)"
        )


def exec_sglang(config: EngineConfig) -> NoReturn:
    """Replaces this process with SGLang's server; returns only by exiting when SGLang is missing."""
    require_sglang()
    argv = sglang_argv(config)
    os.execve(argv[0], argv, sglang_env(config, os.environ))
