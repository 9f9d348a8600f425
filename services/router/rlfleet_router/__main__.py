"""`python -m rlfleet_router --worker-urls URL [URL ...] --port 30000 --policy cache_aware`.

Flags override `RLFLEET_ROUTER_*` environment variables, which override the defaults. Only the flags
and the settings are read before the server modules are imported, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rlfleet.logs import LOG_LEVEL_HELP
from rlfleet.settings_flags import Flag, add_flags, settings_from_flags
from rlfleet_router.config import RouterConfig

# Names follow sglang-router's where it has the same setting (see config.py).
FLAGS: tuple[Flag, ...] = (
    Flag("--worker-urls", "engines to start with (http://host:port)", kind="list", metavar="URL"),
    Flag("--host", "address to listen on (default 127.0.0.1)"),
    Flag("--port", "port to listen on (default 30000)"),
    Flag("--policy", "routing policy: cache_aware (default), least_load, power_of_two or round_robin"),
    Flag("--cache-threshold", "cache_aware: share of a prompt an engine must hold to be preferred (default 0.3)"),
    Flag(
        "--cache-tokens-per-request", "cache_aware: prompt tokens to prefill worth one request in flight (default 40)"
    ),
    Flag("--balance-abs-threshold", "cache_aware: an engine has room for a group within this many (default 10) ..."),
    Flag("--balance-rel-threshold", "cache_aware: ... plus this factor times the mean in flight (default 2.0)"),
    Flag(
        "--balance-share-threshold", "cache_aware: no new prompt above this times the mean recent share (default 1.15)"
    ),
    Flag(
        "--balance-placement-slack",
        "cache_aware: no new group or conversation above the mean placed since the last flush plus this (default 2)",
    ),
    Flag(
        "--max-tree-tokens",
        "cache_aware: budget of the prefix tree in tokens, a node counting 200 more (default 2**24), about 80 MiB",
    ),
    Flag(
        "--prefill-stagger-ms",
        "cache_aware: a repeat of a prompt its engine got less than this long ago, still in flight, waits until then; "
        "0 turns it off (default 50)",
    ),
    Flag("--request-timeout-secs", "bound on one proxied request, retries included (default 600)"),
    Flag(
        "--control-timeout-secs",
        "bound on one engine's answer to /abort_request, /pause_generation, /continue_generation, /flush_cache "
        "(default 60)",
    ),
    Flag("--connect-timeout-secs", "bound on connecting to an engine (default 5)"),
    Flag("--retry-max-retries", "other engines tried after a connection error or 5xx (default 3)"),
    Flag("--retry-initial-backoff-ms", "wait before the first retry (default 50)"),
    Flag("--retry-max-backoff-ms", "longest wait between retries (default 2000)"),
    Flag("--retry-backoff-multiplier", "growth of the wait per retry (default 2.0)"),
    Flag("--health-check-interval-secs", "time between two probes of each engine (default 5)"),
    Flag("--health-check-timeout-secs", "bound on one probe (default 5)"),
    Flag("--health-failure-threshold", "failures in a row that take an engine out of routing (default 3)"),
    Flag("--health-success-threshold", "successes in a row that bring it back (default 2)"),
    Flag("--health-check-endpoint", "engine path to probe (default /health_generate)"),
    Flag("--weight-update-timeout-secs", "bound on one engine's weight load (default 600)"),
    Flag("--trajectory-max-tokens", "token budget of the trajectory cache, ~12 bytes a token (default 2**23)"),
    Flag("--trajectory-max-update-lag", "weight updates after which a trajectory is stale (default 4)"),
    Flag("--restarter", "how failed engines are restarted: local, docker or kubernetes (default: never)"),
    Flag("--restart-timeout-secs", "bound on a restart and the engine's return to health (default 120)"),
    Flag("--restart-initial-backoff-secs", "wait before a failed restart is retried (default 1)"),
    Flag("--restart-max-backoff-secs", "longest wait between restart attempts (default 60)"),
    Flag("--local-engine-command", "local: engine command with {host} and {port} placeholders"),
    Flag("--local-engine-count", "local: engines the router starts itself (default 0)"),
    Flag("--local-engine-host", "local: host of the engines the router starts (default 127.0.0.1)"),
    Flag("--local-engine-log-dir", "local: directory of their logs (default /tmp/rlfleet-engines)"),
    Flag("--local-engine-stop-timeout-secs", "local: SIGTERM to SIGKILL grace (default 10)"),
    Flag("--docker-url", "docker: Docker Engine API (default unix:///var/run/docker.sock)"),
    Flag("--docker-container", "docker: container name template over {host} and {port} (default {host})"),
    Flag("--docker-stop-timeout-secs", "docker: grace before a container is killed (default 10)"),
    Flag("--kubernetes-api-url", "kubernetes: API server (default: in-cluster service account)"),
    Flag("--kubernetes-namespace", "kubernetes: namespace (default: the router's own)"),
    Flag("--kubernetes-label-selector", "kubernetes: labels of engine pods and EndpointSlices"),
    Flag("--kubernetes-discovery-interval-secs", "kubernetes: time between two EndpointSlices lookups (default 5)"),
    Flag("--kubernetes-engine-port", "kubernetes: engine port (default: the slices' only port; of several, none)"),
    Flag("--kubernetes-timeout-secs", "kubernetes: bound on one API call (default 10)"),
    Flag("--log-level", LOG_LEVEL_HELP),
    Flag("--max-request-bytes", "largest request body accepted, 413 beyond (default 64 MiB)"),
    Flag(
        "--max-whole-answer-bytes",
        "largest plain answer read whole before it is sent, so one cut short is retried (default 256 MiB)",
    ),
    Flag("--api-token-file", "file holding the API token admin requests must carry (default: none, open)"),
    Flag("--disable-retries", "send each request to one engine only", kind="switch"),
    Flag("--kubernetes-discovery", "kubernetes: follow the engine EndpointSlices' addresses", kind="switch"),
)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet_router",
        description="rlfleet router: routes SGLang requests across a fleet of engines, "
        "checks their health and keeps them on one weight version.",
    )
    add_flags(parser, FLAGS, RouterConfig)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parses `argv` (flags win over RLFLEET_ROUTER_* variables) into a validated config."""
    parser = build_arg_parser()
    return settings_from_flags(RouterConfig, FLAGS, parser.parse_args(argv), parser)


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)

    import uvicorn

    from rlfleet.logs import init_logging
    from rlfleet_router.http_app import create_app
    from rlfleet_router.http_protocol import RouterHttpProtocol

    init_logging("router", config.log_level)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_config=None,
        # The C parser (generation requests served from it, see http_protocol.py) and event loop, no
        # per-request access log line, and no X-Forwarded-* rewriting of the client address the router never
        # reads: each is CPU on every request's path through the router.
        http=RouterHttpProtocol,
        loop="uvloop",
        access_log=False,
        proxy_headers=False,
        # Streams to a dead client must not hold shutdown hostage.
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
