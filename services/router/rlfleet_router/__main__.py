"""`python -m rlfleet_router --worker-urls URL [URL ...] --port 30000 --policy cache_aware`.

Flags override `RLFLEET_ROUTER_*` environment variables, which override the defaults. Only the
flags are parsed before the server modules are imported, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# (flag, type, help); each flag maps to the RouterConfig field of the same name with '_' for '-'.
VALUE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", int, "port to listen on (default 30000)"),
    ("--policy", str, "routing policy: cache_aware (default), least_load, power_of_two or round_robin"),
    ("--cache-threshold", float, "cache_aware: share of a prompt an engine must hold to be preferred (default 0.3)"),
    ("--cache-tokens-per-request", int, "cache_aware: prompt tokens to prefill worth one request in flight (40)"),
    ("--balance-abs-threshold", int, "cache_aware: an engine has room for a group within this many (10) ..."),
    ("--balance-rel-threshold", float, "cache_aware: ... plus this factor times the mean in flight (1.25)"),
    ("--balance-share-threshold", float, "cache_aware: no new prompt above this times the mean recent share (1.15)"),
    ("--max-tree-tokens", int, "cache_aware: global token budget of the prefix tree (default 2**24)"),
    ("--request-timeout-secs", float, "bound on one proxied request, retries included (default 600)"),
    ("--connect-timeout-secs", float, "bound on connecting to an engine (default 5)"),
    ("--retry-max-retries", int, "other engines tried after a connection error or 5xx (default 3)"),
    ("--retry-initial-backoff-ms", int, "wait before the first retry (default 50)"),
    ("--retry-max-backoff-ms", int, "longest wait between retries (default 2000)"),
    ("--retry-backoff-multiplier", float, "growth of the wait per retry (default 2.0)"),
    ("--health-check-interval-secs", float, "time between two probes of each engine (default 5)"),
    ("--health-check-timeout-secs", float, "bound on one probe (default 5)"),
    ("--health-failure-threshold", int, "failures in a row that take an engine out of routing (default 3)"),
    ("--health-success-threshold", int, "successes in a row that bring it back (default 2)"),
    ("--health-check-endpoint", str, "engine path to probe (default /health_generate)"),
    ("--weight-update-timeout-secs", float, "bound on one engine's weight load (default 600)"),
    ("--trajectory-max-tokens", int, "token budget of the trajectory cache (default 2**24)"),
    ("--trajectory-max-update-lag", int, "weight updates after which a trajectory is stale (default 1)"),
    ("--restarter", str, "how failed engines are restarted: local, docker or kubernetes (default: never)"),
    ("--restart-timeout-secs", float, "bound on a restart and the engine's return to health (default 120)"),
    ("--restart-initial-backoff-secs", float, "wait before a failed restart is retried (default 1)"),
    ("--restart-max-backoff-secs", float, "longest wait between restart attempts (default 60)"),
    ("--local-engine-command", str, "local: engine command with {host} and {port} placeholders"),
    ("--local-engine-count", int, "local: engines the router starts itself (default 0)"),
    ("--local-engine-host", str, "local: host of the engines the router starts (default 127.0.0.1)"),
    ("--local-engine-log-dir", str, "local: directory of their logs (default /tmp/rlfleet-engines)"),
    ("--local-engine-stop-timeout-secs", float, "local: SIGTERM to SIGKILL grace (default 10)"),
    ("--docker-url", str, "docker: Docker Engine API (default unix:///var/run/docker.sock)"),
    ("--docker-container", str, "docker: container name template over {host} and {port} (default {host})"),
    ("--docker-stop-timeout-secs", int, "docker: grace before a container is killed (default 10)"),
    ("--kubernetes-api-url", str, "kubernetes: API server (default: in-cluster service account)"),
    ("--kubernetes-namespace", str, "kubernetes: namespace (default: the router's own)"),
    ("--kubernetes-label-selector", str, "kubernetes: labels of engine pods and Endpoints"),
    ("--kubernetes-discovery-interval-secs", float, "kubernetes: time between two Endpoints lookups (default 5)"),
    ("--kubernetes-engine-port", int, "kubernetes: engine port (default: the Endpoints' first port)"),
    ("--kubernetes-timeout-secs", float, "kubernetes: bound on one API call (default 10)"),
    ("--log-level", str, "debug, info (default), warning, error"),
    ("--max-request-bytes", int, "largest request body accepted, 413 beyond (default 64 MiB)"),
    ("--api-token-file", str, "file holding the API token admin requests must carry (default: none, open)"),
)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser and the flags given on the command line, keyed by RouterConfig field."""
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet_router",
        description="rlfleet router: routes SGLang requests across a fleet of engines, "
        "checks their health and keeps them on one weight version.",
        epilog="Every flag can also be set as an environment variable RLFLEET_ROUTER_<FLAG> "
        "(e.g. RLFLEET_ROUTER_HEALTH_CHECK_INTERVAL_SECS=2).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--worker-urls", nargs="*", metavar="URL", help="engines to start with (http://host:port)")
    for flag, kind, text in VALUE_FLAGS:
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument("--disable-retries", action="store_true", help="send each request to one engine only")
    parser.add_argument(
        "--kubernetes-discovery", action="store_true", help="kubernetes: follow the engine Endpoints' addresses"
    )
    return parser, vars(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> None:
    parser, overrides = parse_args(argv)

    from pydantic import ValidationError

    from rlfleet_router.config import RouterConfig

    try:
        config = RouterConfig(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        parser.error(problems)

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
