"""Settings of the reward hub (environment prefix `RLFLEET_REWARD_`, command-line flags override)."""

from __future__ import annotations

import os

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.logs import LogLevel


def _cpu_count() -> int:
    # The CPUs this process may run on (a container's limit), not the machine's.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class RewardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_REWARD_", extra="forbid")

    host: str = Field(default="0.0.0.0", description="Interface the HTTP and gRPC servers bind.")
    port: int = Field(
        default=8001, ge=0, le=65535, description="HTTP port (POST /score, /functions, /health, /metrics)."
    )
    grpc_port: int = Field(default=50053, ge=0, le=65535, description="gRPC port of the rlfleet.v1.Reward service.")
    workers: int = Field(
        default_factory=_cpu_count, ge=1, description="Worker processes running reward functions (default: CPUs)."
    )
    default_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Time limit of one function on one item when the spec sets none."
    )
    max_timeout_seconds: float = Field(default=300.0, gt=0, description="Largest time limit a spec may ask for.")
    max_batch_size: int = Field(
        default=4096, ge=1, description="Most items in one request; more is RESOURCE_EXHAUSTED."
    )
    max_concurrent_io_calls: int = Field(
        default=64, ge=1, description="Network-bound calls (remote, judge) in flight at once, across requests."
    )
    max_pending_jobs: int = Field(
        default=16384,
        ge=1,
        description="Most (item, term) jobs held at once across requests, waiting or running; a request that would "
        "pass it is refused (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED) unless the hub holds none.",
    )
    max_request_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest request body (HTTP) or message (gRPC) accepted."
    )
    shutdown_grace_seconds: float = Field(
        default=10.0, ge=0, description="How long in-flight requests may finish after SIGTERM before they are cut off."
    )
    log_level: LogLevel = Field(default="info", description="Root log level.")

    @model_validator(mode="after")
    def _default_within_max(self) -> RewardSettings:
        if self.default_timeout_seconds > self.max_timeout_seconds:
            raise ValueError(
                f"default_timeout_seconds ({self.default_timeout_seconds}) exceeds max_timeout_seconds "
                f"({self.max_timeout_seconds}); raise the max or lower the default"
            )
        return self
