"""Settings of the reward hub (environment prefix `RLFLEET_REWARD_`, command-line flags override), and the
caps it puts on what a run spec's params may ask (`SpecCaps`, read from the environment by the params models)."""

from __future__ import annotations

import functools
import os
import re

from pydantic import AnyHttpUrl, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.logs import LogLevel


def _cpu_count() -> int:
    # The CPUs this process may run on (a container's limit), not the machine's.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


DEFAULT_ROUTER_URL = "http://127.0.0.1:30000"
"""Where `judge` finds the router when a spec names none: the local fleet's (`rlfleet up`)."""


class SpecCaps(BaseSettings):
    """What a run spec may make the hub do, whatever its params ask: the hub's side of the params check.

    The params models (`CodeParams`, `RemoteParams`, `JudgeParams`) read these from the environment
    each time a spec is validated (`/validate` at submit, every `/score`), so they have no flags: set
    them as `RLFLEET_REWARD_*` variables. Lists are JSON: `'["http://rm:8080/score"]'`.
    """

    model_config = SettingsConfigDict(env_prefix="RLFLEET_REWARD_", extra="ignore")

    code_max_memory_mb: int = Field(
        default=1024, ge=64, description="Largest `memory_mb` (address space of each process) a `code` spec may ask."
    )
    code_max_processes: int = Field(
        default=64,
        ge=2,
        description="Largest `max_processes` (processes and threads of one test) a `code` spec may ask.",
    )
    code_max_total_memory_mb: int = Field(
        default=16384,
        ge=128,
        description="Largest `memory_mb` x `max_processes` of a `code` spec: the address space one test may "
        "hold. Where the hub has a memory budget (`code_memory_budget_mb`, or a container's limit), a test is also "
        "held to its worker's share of it; without one the hub's worst case is `workers` times this.",
    )
    code_max_file_size_mb: int = Field(
        default=64, ge=0, description="Largest `file_size_mb` (one file, or stdout) a `code` spec may ask."
    )
    code_max_disk_mb: int = Field(
        default=256,
        ge=1,
        description="Largest `disk_mb` (what one test's directory may hold) a `code` spec may ask; the hub's worst "
        "case on disk is `workers` times this, plus stdout and stderr (each up to `file_size_mb`) per worker.",
    )
    remote_url_prefixes: list[AnyHttpUrl] = Field(
        default_factory=list,
        description="URLs `remote` may POST to: a spec's `url` must have one's scheme, host and port, and its path "
        "under the prefix's path (whole segments). Empty (the default): `remote` is off.",
    )
    judge_router_urls: list[AnyHttpUrl] = Field(
        default_factory=lambda: [AnyHttpUrl(DEFAULT_ROUTER_URL)],
        description="Routers `judge` may use: a spec's `router_url` must be one of them; the judge POSTs only to "
        "its `/generate` (api 'generate') or `/v1/chat/completions` (api 'chat').",
    )

    @field_validator("remote_url_prefixes", "judge_router_urls")
    @classmethod
    def _plain_urls(cls, urls: list[AnyHttpUrl]) -> list[AnyHttpUrl]:
        for url in urls:
            if url.username is not None or url.password is not None or url.query or url.fragment:
                raise ValueError(f"{url}: give scheme, host, port and path only (no user, query or fragment)")
        return urls

    def allows_remote(self, url: AnyHttpUrl) -> bool:
        """True when `url` lies under one of `remote_url_prefixes`."""
        return _plain(url) and any(
            _same_server(url, prefix) and _under(url.path, prefix.path) for prefix in self.remote_url_prefixes
        )

    def allows_judge_router(self, url: AnyHttpUrl) -> bool:
        """True when `url` is one of `judge_router_urls` (a trailing slash aside) and has no query."""
        return (
            _plain(url)
            and not url.query
            and any(
                _same_server(url, router) and _trimmed(url.path) == _trimmed(router.path)
                for router in self.judge_router_urls
            )
        )


def spec_caps() -> SpecCaps:
    """The caps the environment sets now; parsed once per distinct set of values, since every spec asks."""
    return _parsed_caps(tuple(os.environ.get(f"RLFLEET_REWARD_{name.upper()}") for name in SpecCaps.model_fields))


@functools.lru_cache(maxsize=4)
def _parsed_caps(values: tuple[str | None, ...]) -> SpecCaps:
    del values  # the cache key only: SpecCaps reads the same variables
    return SpecCaps()


def _plain(url: AnyHttpUrl) -> bool:
    # A user part would make a string prefix lie about the host (http://rm:8080@engine/).
    return url.username is None and url.password is None and not url.fragment


def _same_server(url: AnyHttpUrl, listed: AnyHttpUrl) -> bool:
    return (url.scheme, url.host, url.port) == (listed.scheme, listed.host, listed.port)


def _trimmed(path: str | None) -> str:
    return (path or "/").rstrip("/")


def _under(path: str | None, prefix: str | None) -> bool:
    # Whole segments: /score admits /score and /score/batch, not /scoreboard. Both paths are normalized (no `..`),
    # but an encoded slash is left as it is: a server that decodes it before routing would read /score/..%2fx as /x.
    path, prefix = path or "/", _trimmed(prefix)
    if _ENCODED_SLASH.search(path):
        return False
    return path == prefix or path.startswith(prefix + "/")


_ENCODED_SLASH = re.compile(r"%(?:2f|5c)", re.IGNORECASE)


class RewardSettings(SpecCaps):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_REWARD_", extra="forbid")

    host: str = Field(
        default="127.0.0.1",
        description="Interface the HTTP and gRPC servers bind; the hub checks no token, so only the fleet may reach it "
        "(the image sets 0.0.0.0, behind its network policy).",
    )
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
        description="Most (item, term) jobs held at once across requests, waiting for a worker or running; a request "
        "that would pass it waits its turn for room (first come, first served) unless the hub holds none.",
    )
    admission_wait_seconds: float = Field(
        default=5.0,
        ge=0,
        description="How long a request may wait for room under `max_pending_jobs` before it is refused (HTTP 429 "
        "with Retry-After, gRPC RESOURCE_EXHAUSTED); 0 refuses at once.",
    )
    max_waiting_requests: int = Field(
        default=64,
        ge=0,
        description="Most requests waiting for room at once; one more is refused at once (HTTP 429, gRPC "
        "RESOURCE_EXHAUSTED). Each holds its parsed request in memory while it waits.",
    )
    max_request_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Largest request body (HTTP) or message (gRPC) accepted."
    )
    shutdown_grace_seconds: float = Field(
        default=10.0, ge=0, description="How long in-flight requests may finish after SIGTERM before they are cut off."
    )
    code_memory_budget_mb: int | None = Field(
        default=None,
        ge=1,
        description="What the `code` sandbox's tests may hold together, split evenly among the workers (a worker runs "
        "one test at a time). Default: the container's memory limit (cgroup memory.max, or v1 "
        "memory.limit_in_bytes) less `code_memory_reserve_mb`; without a limit, none, and each test is bound only "
        "by its own `memory_mb` x `max_processes`.",
    )
    code_memory_reserve_mb: int = Field(
        default=512,
        ge=0,
        description="What the hub keeps of the container's memory limit for its own processes (servers, fork server, "
        "workers) when it derives `code_memory_budget_mb` from that limit.",
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
