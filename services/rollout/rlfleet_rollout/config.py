"""Settings of the orchestrator process, and the command line that fills them.

Every setting can come from the environment as `RLFLEET_ROLLOUT_<FIELD>` (flags win; `--help` lists
them all, and an RLFLEET_ROLLOUT_* variable that names no setting is refused). Nothing here imports the
servers or the tokenizer, so `--help` answers instantly.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.logs import LOG_LEVEL_HELP, LogLevel
from rlfleet.settings_flags import Flag, add_flags, settings_from_flags


class RolloutConfig(BaseSettings):
    """One orchestrator: where it listens, the services it calls, and how long it waits for each."""

    # The docstrings below are the descriptions `--help` shows for the settings without a flag.
    model_config = SettingsConfigDict(env_prefix="RLFLEET_ROLLOUT_", extra="ignore", use_attribute_docstrings=True)

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
    """Reward hub (/score, and /validate at every submit)."""
    trainer_address: str = "127.0.0.1:50052"
    """host:port of the trainer's gRPC service."""
    generate_timeout_s: float = Field(default=300.0, gt=0)
    """Bound on one /generate request, retries included."""
    score_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on one /score request, retries included."""
    reward_list_timeout_s: float = Field(default=10.0, gt=0)
    """Bound on the reward hub's /validate, asked at every submit to check the run's reward terms."""
    trainer_start_timeout_s: float = Field(default=600.0, gt=0)
    """Bound on Trainer.StartRun (it loads the policy and makes the fleet serve version 0)."""
    trainer_call_timeout_s: float = Field(default=30.0, gt=0)
    """Bound on every other trainer call (Status, StopRun)."""
    step_timeout_s: float = Field(default=3600.0, gt=0)
    """How long the run may wait for the trainer to reach one weight version before the run fails; also the bound
    on getting the trainer to let go of a run that ended (StopRun, asked again until it has)."""
    stall_after_s: float = Field(default=600.0, gt=0)
    """No progress for this long makes the step watchdog report the run as stalled (a run event and a metric)."""
    poll_interval_s: float = Field(default=1.0, gt=0)
    """Pause between trainer Status polls, and the longest a watcher goes without re-reading Redis."""
    max_concurrent_generations: int = Field(default=8, gt=0)
    """Generate requests in flight at once (one request is one prompt's group)."""
    max_episodes_under_way: int = Field(default=64, gt=0)
    """multi_turn episodes of a run's training under way at once. Started all at once, every episode's first turn
    ran before any second one, and together their trajectories passed the router's cache budget, which evicted the
    episodes waiting for their next turn (16 groups of 8 over a 20k-token budget lost 65 of 128 samples)."""
    env_reply_threads: int = Field(default=16, gt=0)
    """Threads that run multi_turn environments' replies (their own, apart from those of Redis calls); a reply that
    hangs past its time keeps its thread and another takes its place (up to 4 per thread), and replies beyond the
    free threads wait for one."""
    env_reply_timeout_s: float = Field(default=60.0, gt=0)
    """Bound on one environment reply, a wait for a free thread included: past it the episode's sample fails
    (`turn N: environment did not reply within 60s`) and the reply keeps its thread (a thread cannot be stopped)."""
    eval_batch_size: int = Field(default=32, gt=0)
    """Held-out samples per /generate request during evaluation; of a multi_turn run, episodes under way at once."""
    watch_keepalive_s: float = Field(default=15.0, gt=0)
    """A REST watch stream (`GET /v1/runs/{id}:watch`) sends a `: keep-alive` comment after this long without a
    change, so proxies and clients keep a quiet run's stream open (`rlfleet watch` gives up after 60 s of silence)."""
    grpc_keepalive_s: float = Field(default=30.0, ge=1)
    """The gRPC server pings a connection idle this long (dropping it when 10 s pass without the answer), and
    lets clients send their own keepalive pings as often as every third of it."""
    run_data_retention_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    """How long a run's sample stream, its dead letters and its data position stay in Redis after the run ends
    (its record stays): time to inspect them, and Redis does not fill up with runs that are over."""
    run_lease_s: float = Field(default=15.0, ge=1)
    """How long the lease that lets one orchestrator drive a run lasts unrenewed (it renews it every quarter of this):
    another orchestrator on the same Redis takes a run over this long after its driver died."""
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    """How long open requests and streams get to finish on SIGTERM."""
    log_level: LogLevel = "info"
    """Root log level (debug, info, warning, error, critical)."""
    api_token_file: str | None = None
    """File holding the API token every Runs API call must carry (`Authorization: Bearer`); unset: open."""
    data_roots: list[Path] = Field(default_factory=list)
    """Directories a run spec's model.path, model.tokenizer_path and dataset paths must lie under (resolved, symlinks
    followed), as a JSON list (`["/data"]`); a spec naming anything else is refused at submit. Empty (the default):
    any path this process can read, as `rlfleet up` on one machine needs."""

    @field_validator("router_url", "reward_url")
    @classmethod
    def _strip_slash(cls, url: str) -> str:
        return url.rstrip("/")


FLAGS: tuple[Flag, ...] = (
    Flag("--host", "Address to bind (default 127.0.0.1)."),
    Flag("--port", "HTTP port of the Runs API (default 8000)."),
    Flag("--grpc-port", "gRPC port of the Runs service (default 50051)."),
    Flag("--redis-url", "Redis URL (default redis://127.0.0.1:6379/0)."),
    Flag("--redis-prefix", "Prefix of every Redis key (default 'rlfleet:')."),
    Flag("--router-url", "Router URL (default http://127.0.0.1:30000)."),
    Flag("--reward-url", "Reward hub URL (default http://127.0.0.1:8001)."),
    Flag("--trainer-address", "Trainer gRPC host:port (default 127.0.0.1:50052)."),
    Flag(
        "--generate-timeout",
        "Seconds one /generate may take, retries included (default 300).",
        field="generate_timeout_s",
    ),
    Flag("--score-timeout", "Seconds one /score may take, retries included (default 120).", field="score_timeout_s"),
    Flag(
        "--trainer-start-timeout",
        "Seconds Trainer.StartRun may take (default 600).",
        field="trainer_start_timeout_s",
    ),
    Flag(
        "--trainer-call-timeout",
        "Seconds any other trainer call may take (default 30).",
        field="trainer_call_timeout_s",
    ),
    Flag(
        "--step-timeout",
        "Seconds to wait for the trainer to reach a weight version (default 3600).",
        field="step_timeout_s",
    ),
    Flag("--poll-interval", "Seconds between trainer Status polls (default 1).", field="poll_interval_s"),
    Flag(
        "--stall-after",
        "Seconds without progress before a run is reported stalled (default 600).",
        field="stall_after_s",
    ),
    Flag("--max-concurrent-generations", "Generate requests in flight (default 8)."),
    Flag("--max-episodes-under-way", "multi_turn episodes of a run's training under way at once (default 64)."),
    Flag("--log-level", LOG_LEVEL_HELP),
    Flag("--api-token-file", "File holding the API token the Runs API requires (default: none)."),
)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet_rollout",
        description="rlfleet rollout orchestrator: the Runs API (REST and gRPC) and the run loop.",
    )
    add_flags(parser, FLAGS, RolloutConfig)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> RolloutConfig:
    """Parses `argv` (flags win over RLFLEET_ROLLOUT_* variables) into a validated config."""
    parser = build_arg_parser()
    return settings_from_flags(RolloutConfig, FLAGS, parser.parse_args(argv), parser)
