"""Router settings: environment variables `RLFLEET_ROUTER_<FIELD>`, overridden by command-line flags.

Flag names follow sglang-router where it has the same setting (`--worker-urls`, `--policy`,
`--health-check-interval-secs`, `--retry-max-retries`, ...), so a deployment can switch between the
two routers without relearning the knobs.
"""

from __future__ import annotations

import shlex
import string
from dataclasses import fields

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.errors import InvalidInput
from rlfleet.logs import LogLevel
from rlfleet_router.policies import PolicyOptions, available_policies
from rlfleet_router.radix_tree import NODE_TOKENS
from rlfleet_router.restarters import restarter_names
from rlfleet_router.workers import normalize_worker_url

POLICY_DEFAULTS = PolicyOptions()


class RouterConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_ROUTER_", extra="forbid")

    worker_urls: list[str] = Field(
        default_factory=list, description="Engines the fleet starts with (http://host:port)."
    )
    host: str = Field("127.0.0.1", description="Address the router listens on.")
    port: int = Field(30000, ge=0, le=65535, description="Port the router listens on.")
    policy: str = Field(
        "cache_aware", description="Routing policy by name: cache_aware, least_load, power_of_two, round_robin."
    )
    cache_threshold: float = Field(
        POLICY_DEFAULTS.cache_threshold,
        ge=0.0,
        le=1.0,
        description="cache_aware: fraction of a prompt an engine must hold to be preferred.",
    )
    cache_tokens_per_request: int = Field(
        POLICY_DEFAULTS.cache_tokens_per_request,
        ge=1,
        description="cache_aware: prompt tokens to prefill costing an engine as much as a request in flight.",
    )
    balance_abs_threshold: int = Field(
        POLICY_DEFAULTS.balance_abs_threshold,
        ge=0,
        description="cache_aware: an engine has room for a prompt's group while its requests in flight ...",
    )
    balance_rel_threshold: float = Field(
        POLICY_DEFAULTS.balance_rel_threshold,
        ge=1.0,
        description="cache_aware: ... plus the group stay within the above plus this times the mean.",
    )
    balance_share_threshold: float = Field(
        POLICY_DEFAULTS.balance_share_threshold,
        ge=1.0,
        description="cache_aware: an engine whose recent requests exceed this times the mean (+1) takes no new prompt.",
    )
    balance_placement_slack: float = Field(
        POLICY_DEFAULTS.balance_placement_slack,
        ge=1.0,
        description="cache_aware: an engine takes a new group or conversation only while, with it, its groups and "
        "conversations placed since the caches were last emptied stay within the mean per engine plus this many.",
    )
    max_tree_tokens: int = Field(
        POLICY_DEFAULTS.max_tree_tokens,
        gt=NODE_TOKENS,
        description="cache_aware: global budget of the prefix tree, in tokens (characters of text prompts), each "
        f"node of the tree counting {NODE_TOKENS} more for its own memory (about 0.8 KB); least recently used "
        "prefixes are evicted beyond it. About 5 bytes of router memory a unit whatever the prompts: the default "
        "about 80 MiB.",
    )
    prefill_stagger_ms: float = Field(
        50.0,
        ge=0.0,
        le=1000.0,
        description="cache_aware: a request repeating a prompt sent to its engine less than this long ago by a "
        "request still in flight there, or sharing at least half of it, waits until then, so it arrives once the "
        "first's prefill has begun and finds what they share cached (engines share nothing within one prefill "
        "batch); 0 turns it off.",
    )

    request_timeout_secs: float = Field(
        600.0, gt=0, description="Upper bound on one proxied request, retries included, until its last byte."
    )
    connect_timeout_secs: float = Field(5.0, gt=0, description="Bound on opening a connection to an engine.")
    control_timeout_secs: float = Field(
        60.0,
        gt=0,
        description="Bound on one engine's answer to an abort, pause, continue or flush sent to every engine.",
    )
    max_request_bytes: int = Field(
        64 * 2**20, ge=1024, description="Largest request body accepted (413 beyond); the router buffers each one."
    )
    max_whole_answer_bytes: int = Field(
        256 * 2**20,
        ge=0,
        description="Largest plain answer read whole before any of it is sent, so one cut short at its engine is "
        "retried; a larger one is relayed as it arrives and cannot be retried once begun.",
    )
    retry_max_retries: int = Field(
        3, ge=0, description="Further engines tried after a connection error or 5xx before any byte was returned."
    )
    retry_initial_backoff_ms: int = Field(50, ge=0, description="Wait before the first retry.")
    retry_max_backoff_ms: int = Field(2000, ge=0, description="Longest wait between two retries.")
    retry_backoff_multiplier: float = Field(2.0, ge=1.0, description="Growth of the wait from one retry to the next.")
    disable_retries: bool = Field(False, description="Send each request to one engine only.")

    health_check_interval_secs: float = Field(5.0, gt=0, description="Time between two probes of every engine.")
    health_check_timeout_secs: float = Field(5.0, gt=0, description="Bound on one probe.")
    health_failure_threshold: int = Field(3, ge=1, description="Failures in a row that take an engine out of routing.")
    health_success_threshold: int = Field(
        2, ge=1, description="Successes in a row that bring a taken-out engine back (a new one needs one)."
    )
    health_check_endpoint: str = Field(
        "/health_generate",
        description="Engine path probed: /health_generate (runs the model) or /health (recent SGLang: HTTP only).",
    )

    weight_update_timeout_secs: float = Field(
        600.0, gt=0, description="Bound on one engine's /update_weights_from_disk (fan-out and rejoin alike)."
    )
    trajectory_max_tokens: int = Field(
        2**23,
        ge=1,
        description="Token budget of the trajectory cache (least recently used trajectories go first). A token costs "
        "about 12 bytes of router memory (4 in a prompt, 13 in a response); each trajectory is also charged 64 tokens "
        "for its entry and 32 for each turn's record. The default holds about 100 MiB, leaving a 1 GiB router room "
        "for the cache_aware prefix tree (about 80 MiB by default).",
    )
    trajectory_max_update_lag: int = Field(
        4,
        ge=0,
        description="Fleet weight updates after its last turn before a trajectory is evicted as stale; keep it above "
        "the rollout.max_staleness of the runs the fleet serves, whose episodes may wait that many updates between "
        "two turns (the token budget bounds the memory either way).",
    )

    restarter: str | None = Field(
        None, description="How failed engines are restarted, by name: local, docker, kubernetes (unset: never)."
    )
    restart_timeout_secs: float = Field(
        120.0, gt=0, description="Bound on one restart, and on the restarted engine becoming healthy again."
    )
    restart_initial_backoff_secs: float = Field(1.0, ge=0, description="Wait before a failed restart is retried.")
    restart_max_backoff_secs: float = Field(60.0, ge=0, description="Longest wait between two restart attempts.")
    local_engine_command: str = Field(
        "", description="local: engine command line with {host} and {port}, e.g. 'python -m rlfleet_engine ...'."
    )
    local_engine_count: int = Field(0, ge=0, description="local: engines the router starts itself from the command.")
    local_engine_host: str = Field("127.0.0.1", description="local: host the engines the router starts listen on.")
    local_engine_log_dir: str = Field("/tmp/rlfleet-engines", description="local: where engine logs are written.")
    local_engine_stop_timeout_secs: float = Field(
        10.0, gt=0, description="local: SIGTERM to SIGKILL grace when an engine is stopped."
    )
    docker_url: str = Field("unix:///var/run/docker.sock", description="docker: the Docker Engine API.")
    docker_container: str = Field(
        "{host}", description="docker: container of an engine, a template over its URL's {host} and {port}."
    )
    docker_stop_timeout_secs: int = Field(10, ge=0, description="docker: grace before the container is killed.")
    kubernetes_api_url: str | None = Field(
        None, description="kubernetes: API server URL (unset: the in-cluster service account)."
    )
    kubernetes_namespace: str | None = Field(None, description="kubernetes: namespace (unset: the router's own).")
    kubernetes_label_selector: str = Field(
        "app.kubernetes.io/component=engine", description="kubernetes: labels of the engine pods and EndpointSlices."
    )
    kubernetes_discovery: bool = Field(
        False, description="kubernetes: follow the engine EndpointSlices' ready addresses."
    )
    kubernetes_discovery_interval_secs: float = Field(5.0, gt=0, description="kubernetes: time between two lookups.")
    kubernetes_engine_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="kubernetes: engine port in the EndpointSlices (unset: their only port; of several, none).",
    )
    kubernetes_timeout_secs: float = Field(10.0, gt=0, description="kubernetes: bound on one API call.")
    log_level: LogLevel = Field("info", description="Log level of the router process.")
    api_token_file: str | None = Field(
        None, description="File holding the API token admin requests (every non-GET but generation) must carry."
    )

    def policy_options(self) -> PolicyOptions:
        """The policy settings among these (the rest of PolicyOptions keeps its defaults)."""
        return PolicyOptions(
            **{f.name: getattr(self, f.name) for f in fields(PolicyOptions) if f.name in type(self).model_fields}
        )

    @field_validator("worker_urls")
    @classmethod
    def _normalize_urls(cls, urls: list[str]) -> list[str]:
        try:
            return [normalize_worker_url(u) for u in urls]
        except InvalidInput as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        known = available_policies()
        if name not in known:
            raise ValueError(f"unknown routing policy {name!r}; known policies: {', '.join(sorted(known))}")
        return name

    @field_validator("restarter")
    @classmethod
    def _known_restarter(cls, name: str | None) -> str | None:
        if name is None or name in ("", "none"):
            return None
        known = restarter_names()
        if name not in known:
            raise ValueError(f"unknown restarter {name!r}; known restarters: {', '.join(known)}")
        return name

    @field_validator("health_check_endpoint")
    @classmethod
    def _endpoint_path(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"health_check_endpoint {path!r} must be a path starting with '/', e.g. /health")
        return path

    @field_validator("local_engine_command", "docker_container")
    @classmethod
    def _url_template(cls, template: str, info: ValidationInfo) -> str:
        """Only {host} and {port} are filled in: any other placeholder would fail at the first restart."""
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            if info.field_name == "local_engine_command":
                shlex.split(template)
        except ValueError as exc:
            raise ValueError(f"{info.field_name} {template!r} does not parse: {exc}") from None
        if unknown := sorted(names - {"host", "port"}):
            raise ValueError(
                f"{info.field_name} {template!r} has placeholders {unknown}; only {{host}} and {{port}} are filled in "
                "(write a literal brace as {{ or }})"
            )
        return template

    @model_validator(mode="after")
    def _backoff_order(self) -> RouterConfig:
        if self.retry_max_backoff_ms < self.retry_initial_backoff_ms:
            raise ValueError("retry_max_backoff_ms must be >= retry_initial_backoff_ms")
        if self.restart_max_backoff_secs < self.restart_initial_backoff_secs:
            raise ValueError("restart_max_backoff_secs must be >= restart_initial_backoff_secs")
        if self.restarter == "local" and not self.local_engine_command:
            raise ValueError(
                "restarter 'local' needs local_engine_command, e.g. "
                "'python -m rlfleet_engine --model-path DIR --host {host} --port {port}'"
            )
        if self.local_engine_count and self.restarter != "local":
            raise ValueError("local_engine_count needs restarter 'local' (it starts the engines)")
        return self
