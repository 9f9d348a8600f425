"""Settings of the orchestrator process, and the command line that fills them.

Every setting can come from the environment as `RLFLEET_ROLLOUT_<FIELD>`; flags win. Nothing here
imports the servers or the tokenizer, so `--help` answers instantly.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RolloutConfig(BaseSettings):
    """One orchestrator: where it listens, the services it calls, and how long it waits for each."""

    model_config = SettingsConfigDict(env_prefix="RLFLEET_ROLLOUT_", extra="ignore")

    host: str = "127.0.0.1"
    """Address the HTTP and gRPC servers bind."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port of the REST Runs API, /health and /metrics."""
    grpc_port: int = Field(default=50051, ge=0, le=65535)
    """Port of the gRPC Runs service."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding run records and sample streams."""
    redis_prefix: str = "rlfleet:"
    """Prefix of every Redis key this orchestrator reads or writes (the trainer must use the same)."""
    router_url: str = "http://127.0.0.1:30000"
    """Router in front of the engines (SGLang's /generate)."""
    reward_url: str = "http://127.0.0.1:8001"
    """Reward hub (/score, /functions)."""
    trainer_address: str = "127.0.0.1:50052"
    """host:port of the trainer's gRPC service."""
    generate_timeout_s: float = Field(default=300.0, gt=0)
    """Bound on one /generate request, retries included."""
    score_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on one /score request, retries included."""
    reward_list_timeout_s: float = Field(default=10.0, gt=0)
    """Bound on the reward hub's /functions, asked at every submit."""
    trainer_start_timeout_s: float = Field(default=600.0, gt=0)
    """Bound on Trainer.StartRun (it loads the policy and makes the fleet serve version 0)."""
    trainer_call_timeout_s: float = Field(default=30.0, gt=0)
    """Bound on every other trainer call (Status, StopRun)."""
    step_timeout_s: float = Field(default=3600.0, gt=0)
    """How long the run may wait for the trainer to reach one weight version before the run fails."""
    stall_after_s: float = Field(default=600.0, gt=0)
    """No progress for this long makes the step watchdog report the run as stalled (a run event and a metric)."""
    poll_interval_s: float = Field(default=1.0, gt=0)
    """Pause between trainer Status polls, and the longest a watcher goes without re-reading Redis."""
    max_concurrent_generations: int = Field(default=8, gt=0)
    """Generate requests in flight at once (one request is one prompt's group)."""
    eval_batch_size: int = Field(default=32, gt=0)
    """Held-out prompts per greedy /generate request during evaluation."""
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    """How long open requests and streams get to finish on SIGTERM."""
    log_level: str = "info"
    """Root log level (debug, info, warning, error)."""
    api_token_file: str | None = None
    """File holding the API token every Runs API call must carry (`Authorization: Bearer`); unset: open."""

    @field_validator("router_url", "reward_url")
    @classmethod
    def _strip_slash(cls, url: str) -> str:
        return url.rstrip("/")


# Flag -> (field, help). Types are parsed by pydantic afterwards; argparse only collects strings.
_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--host", "host", "Address to bind (default 127.0.0.1)."),
    ("--port", "port", "HTTP port of the Runs API (default 8000)."),
    ("--grpc-port", "grpc_port", "gRPC port of the Runs service (default 50051)."),
    ("--redis-url", "redis_url", "Redis URL (default redis://127.0.0.1:6379/0)."),
    ("--redis-prefix", "redis_prefix", "Prefix of every Redis key (default 'rlfleet:')."),
    ("--router-url", "router_url", "Router URL (default http://127.0.0.1:30000)."),
    ("--reward-url", "reward_url", "Reward hub URL (default http://127.0.0.1:8001)."),
    ("--trainer-address", "trainer_address", "Trainer gRPC host:port (default 127.0.0.1:50052)."),
    ("--generate-timeout", "generate_timeout_s", "Seconds one /generate may take, retries included (default 300)."),
    ("--score-timeout", "score_timeout_s", "Seconds one /score may take, retries included (default 120)."),
    ("--trainer-start-timeout", "trainer_start_timeout_s", "Seconds Trainer.StartRun may take (default 600)."),
    ("--trainer-call-timeout", "trainer_call_timeout_s", "Seconds any other trainer call may take (default 30)."),
    ("--step-timeout", "step_timeout_s", "Seconds to wait for the trainer to reach a weight version (default 3600)."),
    ("--poll-interval", "poll_interval_s", "Seconds between trainer Status polls (default 1)."),
    ("--stall-after", "stall_after_s", "Seconds without progress before a run is reported stalled (default 600)."),
    ("--max-concurrent-generations", "max_concurrent_generations", "Generate requests in flight (default 8)."),
    ("--log-level", "log_level", "Log level: debug, info, warning, error (default info)."),
    ("--api-token-file", "api_token_file", "File holding the API token the Runs API requires (default: none)."),
)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet_rollout",
        description="rlfleet rollout orchestrator: the Runs API (REST and gRPC) and the run loop. "
        "Every flag can also be set as RLFLEET_ROLLOUT_<FIELD> in the environment.",
    )
    for flag, field, help_text in _FLAGS:
        parser.add_argument(flag, dest=field, default=None, help=help_text)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> RolloutConfig:
    """Parses `argv` (flags win over RLFLEET_ROLLOUT_* variables) into a validated config."""
    args = build_arg_parser().parse_args(argv)
    given = {field: value for _, field, _ in _FLAGS if (value := getattr(args, field)) is not None}
    return RolloutConfig(**given)
