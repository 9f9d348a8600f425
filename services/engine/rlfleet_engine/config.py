"""Settings of one engine process, and the command line that fills them.

The flags carry SGLang's names (`--model-path`, `--max-running-requests`, ...) so a launcher written
for `python -m sglang.launch_server` starts this engine unchanged; every setting can also come from
the environment as `RLFLEET_ENGINE_<FIELD>` (flags win; `--help` lists them all, and an
RLFLEET_ENGINE_* variable that names no setting is refused). Nothing here imports torch, so `--help`
answers instantly.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.logs import LOG_LEVEL_HELP, LogLevel
from rlfleet.settings_flags import Flag, add_flags, settings_from_flags

BackendName = Literal["transformers", "sglang", "sim"]


def blank_path_problem(field: str, path: str) -> str | None:
    """What is wrong with `path` given as `field` if it is empty or only whitespace, None otherwise. Path("") is
    the working directory, so such a path was read from there and failed later with a message about its files."""
    if path.strip():
        return None
    return f"{field} is {'empty' if not path else 'only whitespace'} ({path!r}): name a Hugging Face model directory"


class EngineConfig(BaseSettings):
    """One engine: which model, where it listens, and how large a batch it runs."""

    model_config = SettingsConfigDict(env_prefix="RLFLEET_ENGINE_", extra="ignore", protected_namespaces=())

    model_path: str
    """Hugging Face model directory (config.json + safetensors) to serve."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to model_path."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: int = Field(default=30000, ge=0, le=65535)
    """Port the HTTP server binds (SGLang's default 30000)."""
    served_model_name: str | None = None
    """Name reported in /v1/models and the `model_name` metric label; defaults to model_path."""
    context_length: int | None = Field(default=None, gt=0)
    """Longest prompt + completion in tokens; defaults to the model's max_position_embeddings."""
    max_running_requests: int = Field(default=16, gt=0)
    """Most sequences decoded together in one batch; further requests wait in the queue. The sglang backend
    passes it on only when set: SGLang sizes its batch from the KV pool."""
    max_prefill_tokens: int = Field(default=16384, gt=0)
    """Most prompt tokens one prefill batch computes (SGLang's --max-prefill-tokens and its default); the requests
    behind wait for the next iteration. `sim`: uncached tokens (the requests behind find the prefixes this batch
    computed cached). `transformers`: distinct prompts x the longest, as the batch is padded to it (the `n`
    samples of a prompt count once), and it also splits the recomputation of the running rows' KV after a weight
    load. A single request over it still runs, alone. The sglang backend does not pass it on."""
    random_seed: int = 0
    """Seed of the sampler's random generator. The sglang backend passes it on only when set: SGLang seeds each
    server at random."""
    log_level: LogLevel = "info"
    """Root log level (debug, info, warning, error, critical)."""
    backend: BackendName = "transformers"
    """What produces the logits: `transformers` runs the real model on CPU; `sglang` execs the real SGLang server;
    `sim` runs no model (a prefix cache and a latency model, for routing experiments)."""
    torch_threads: int | None = Field(default=None, gt=0)
    """Intra-op threads torch may use; unset leaves torch's default (all cores)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision the weights are held and run in. The sglang backend passes it on only when set: SGLang runs the
    checkpoint's."""
    weight_version: str = "default"
    """Version label of the weights loaded at start (SGLang's `--weight-version`)."""
    health_check_timeout_s: float = Field(default=20.0, gt=0)
    """Bound on the one-token generation /health_generate runs."""
    max_pause_s: float = Field(default=600.0, gt=0)
    """`transformers` and `sim` backends: how long generation may stay paused (/pause_generation) with
    /health_generate still answering 200; past it the answer is 503. SGLang answers 503 once its probe
    has waited health_check_timeout_s behind the pause; the router trusts a pause for its
    weight_update_timeout_secs (600 s by default) and probes with /get_model_info meanwhile, so a long
    weight load is never judged by this, while an engine a lost /continue_generation left paused is taken
    out and restarted instead of holding its requests for ever."""
    weight_group_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on joining a trainer's weight update group and on each broadcast received through it. Keep it at
    least the trainer's --weight-sync-timeout-s (120 s by default): an engine that gives up sooner leaves the
    trainer waiting for it to its own bound."""
    sim_vocab_size: int = Field(default=65536, ge=256, le=2**31)
    """`sim` backend: token ids it takes, below this: set it to the vocabulary of the tokenizer its clients use
    (about 152k for Qwen's), whose ids it refused past 65535. Text is one token per character either way."""
    sim_cache_tokens: int = Field(default=1_000_000, ge=16)
    """`sim` backend: tokens of KV memory, held by running requests and the prefix cache (LRU beyond);
    model_path is then only a label."""
    sim_prefill_us_per_token: float = Field(default=25.0, ge=0)
    """`sim` backend: prefill time per uncached prompt token, in microseconds."""
    sim_decode_ms_per_step: float = Field(default=5.0, ge=0)
    """`sim` backend: time of one decode step of a batch of one, in milliseconds."""
    sim_decode_us_per_sequence: float = Field(default=100.0, ge=0)
    """`sim` backend: time each sequence in the batch adds to a decode step, in microseconds."""
    sim_decode_us_per_kv_token: float = Field(default=0.0, ge=0)
    """`sim` backend: time each token of KV the batch holds adds to a decode step, in microseconds (a decode
    step reads every running sequence's whole KV). Off by default so the other sim_* figures keep their
    meaning; ~0.17 us is a 7B fp16 model (0.5 MB per token) on an H100 (3 TB/s)."""
    trust_remote_code: bool = False
    """`sglang` backend: passed on, for a model whose code comes with its checkpoint; the CPU backends load only the
    architectures transformers ships and ignore it."""
    skip_server_warmup: bool = False
    """`sglang` backend: passed on (no warm-up request before the server reports ready); the CPU backends ignore it."""

    @field_validator("model_path", "tokenizer_path")
    @classmethod
    def _a_directory(cls, path: str | None, info: ValidationInfo) -> str | None:
        problem = None if path is None else blank_path_problem(str(info.field_name), path)
        if problem is not None:
            raise ValueError(problem)
        return path

    @model_validator(mode="after")
    def _fill_defaults(self) -> EngineConfig:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        return self


FLAGS: tuple[Flag, ...] = (
    Flag("--model-path", "Hugging Face model directory to serve."),
    Flag("--tokenizer-path", "Tokenizer directory (default: the model path)."),
    Flag("--host", "Address to bind (default 127.0.0.1)."),
    Flag("--port", "Port to bind (default 30000)."),
    Flag("--served-model-name", "Model name reported to clients (default: the model path)."),
    Flag("--context-length", "Longest prompt + completion in tokens (default: the model's)."),
    Flag("--max-running-requests", "Most sequences in one decode batch (default 16); sglang sizes it unless set."),
    Flag("--max-prefill-tokens", "Most prompt tokens per prefill batch (default 16384)."),
    Flag("--random-seed", "Seed of the sampler (default 0); sglang draws one unless set."),
    Flag("--log-level", LOG_LEVEL_HELP),
    Flag("--backend", "transformers (default), sglang (the real SGLang server) or sim (no model)."),
    Flag("--torch-threads", "Intra-op threads for torch (default: torch's choice)."),
    Flag("--dtype", "float32 (default), bfloat16 or float16; sglang runs the checkpoint's unless set."),
    Flag("--weight-version", "Version label of the initial weights (default 'default')."),
    Flag("--health-check-timeout", "Seconds /health_generate may take (default 20).", field="health_check_timeout_s"),
    Flag("--max-pause", "Seconds paused before /health_generate answers 503 (default 600).", field="max_pause_s"),
    Flag(
        "--weight-group-timeout",
        "Seconds to join a weight update group or receive one broadcast (default 120).",
        field="weight_group_timeout_s",
    ),
    Flag("--sim-vocab-size", "sim backend: token ids below this are taken (default 65536)."),
    Flag("--sim-cache-tokens", "sim backend: KV memory in tokens (default 1000000)."),
    Flag("--sim-prefill-us-per-token", "sim backend: prefill us per uncached token (default 25)."),
    Flag("--sim-decode-ms-per-step", "sim backend: ms per decode step of one sequence (default 5)."),
    Flag("--sim-decode-us-per-sequence", "sim backend: us each batched sequence adds (default 100)."),
    Flag("--sim-decode-us-per-kv-token", "sim backend: us each KV token adds to a step (default 0)."),
    Flag("--trust-remote-code", "sglang backend: passed on; the CPU backends ignore it.", kind="switch"),
    Flag("--skip-server-warmup", "sglang backend: passed on; the CPU backends ignore it.", kind="switch"),
)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet_engine",
        description="rlfleet CPU engine: SGLang's HTTP API over a Hugging Face causal LM.",
    )
    add_flags(parser, FLAGS, EngineConfig)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """Parses `argv` (flags win over RLFLEET_ENGINE_* variables) into a validated config."""
    parser = build_arg_parser()
    return settings_from_flags(EngineConfig, FLAGS, parser.parse_args(argv), parser)
