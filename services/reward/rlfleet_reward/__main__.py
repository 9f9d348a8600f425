"""`python -m rlfleet_reward`: the reward hub, HTTP and gRPC in one process, plus its worker pool.

Arguments are parsed before anything heavy is imported, so `--help` answers at once. SIGTERM or
SIGINT stops both servers (in-flight requests get the grace period), then the worker processes.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING

from rlfleet.host_port import host_port
from rlfleet.logs import LOG_LEVEL_HELP
from rlfleet.settings_flags import Flag, add_flags, settings_from_flags
from rlfleet_reward.config import RewardSettings

if TYPE_CHECKING:
    from rlfleet_reward.registry import Registry
    from rlfleet_reward.reward_function import RewardFunction
    from rlfleet_reward.sandbox_memory import MemoryBudget

# What the answers of requests cut off at the end of the shutdown grace get to be written in.
_ANSWER_BEFORE_CUTOFF_SECONDS = 0.5
# The smallest `memory_mb` a `code` spec may ask (CodeParams): a share below it refuses every `code` spec.
_SMALLEST_MEMORY_MB = 64
FLAGS: tuple[Flag, ...] = (
    Flag("--host", "interface to bind (default 127.0.0.1)"),
    Flag("--port", "HTTP port (default 8001)"),
    Flag("--grpc-port", "gRPC port (default 50053)"),
    Flag("--workers", "worker processes (default: CPUs available)"),
    Flag("--default-timeout-seconds", "per-item limit when a spec sets none (default 10)"),
    Flag("--max-timeout-seconds", "largest limit a spec may ask for (default 300)"),
    Flag("--max-batch-size", "most items per request (default 4096)"),
    Flag("--max-concurrent-io-calls", "remote/judge calls in flight at once (default 64)"),
    Flag("--max-pending-jobs", "most (item, term) jobs held at once; more waits its turn (default 16384)"),
    Flag("--admission-wait-seconds", "longest wait for room under --max-pending-jobs, then 429 (default 5)"),
    Flag("--max-waiting-requests", "most requests waiting for room at once; more get 429 at once (default 64)"),
    Flag("--max-request-bytes", "largest request body or message (default 64 MiB)"),
    Flag("--shutdown-grace-seconds", "time in-flight requests get on SIGTERM (default 10)"),
    Flag("--code-memory-budget-mb", "memory code tests may hold together (default: container limit less reserve)"),
    Flag("--code-memory-reserve-mb", "memory kept for the hub when the budget comes from the container (default 512)"),
    Flag("--log-level", LOG_LEVEL_HELP),
)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet_reward",
        description="rlfleet reward hub: reward functions behind HTTP and gRPC.",
    )
    add_flags(parser, FLAGS, RewardSettings)
    return parser


def settings_from_args(argv: Sequence[str] | None = None) -> RewardSettings:
    """Parses `argv` (flags win over RLFLEET_REWARD_* variables) into validated settings."""
    parser = build_arg_parser()
    return settings_from_flags(RewardSettings, FLAGS, parser.parse_args(argv), parser)


async def serve(settings: RewardSettings, registry: Registry) -> None:
    import asyncio
    import contextlib
    import math
    import signal

    import uvicorn

    from rlfleet.http_head_limit import HeadLimitedHttpProtocol
    from rlfleet_reward.grpc_server import create_grpc_server
    from rlfleet_reward.http_app import create_app
    from rlfleet_reward.http_listener import tcp_listener
    from rlfleet_reward.http_retry import close_clients
    from rlfleet_reward.metrics import RewardMetrics
    from rlfleet_reward.scoring import Scorer, ScoringLimits
    from rlfleet_reward.worker_pool import WorkerPool

    class _Server(uvicorn.Server):
        # The hub handles SIGTERM itself so that gRPC and the worker pool stop too.
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    logger = logging.getLogger("rlfleet_reward")
    metrics = RewardMetrics()
    budget = _memory_budget(settings, logger)
    pool = WorkerPool(registry.pool_functions(), settings.workers, memory_budget=budget)
    limits = ScoringLimits(
        settings.default_timeout_seconds,
        settings.max_timeout_seconds,
        settings.max_batch_size,
        settings.max_concurrent_io_calls,
        settings.max_pending_jobs,
        settings.admission_wait_seconds,
        settings.max_waiting_requests,
    )
    scorer = Scorer(registry, pool, limits, metrics)
    # Both ports are bound before any worker starts, so a taken port fails fast with nothing to undo.
    try:
        grpc_server, grpc_port = create_grpc_server(
            scorer, host_port(settings.host, settings.grpc_port), settings.max_request_bytes
        )
        http_socket = tcp_listener(settings.host, settings.port)
    except (OSError, RuntimeError) as exc:
        raise SystemExit(f"reward hub cannot listen on {settings.host}: {exc}") from None
    http = _Server(
        uvicorn.Config(
            create_app(scorer, metrics, settings.max_request_bytes),
            log_config=None,
            http=HeadLimitedHttpProtocol,
            lifespan="off",
            timeout_graceful_shutdown=max(1, math.ceil(settings.shutdown_grace_seconds)),
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            pool.start()
        except RuntimeError as exc:  # a worker could not import the reward functions: nothing can be scored
            await grpc_server.start()  # a grpc.aio server gives its port back only once started and stopped
            await grpc_server.stop(None)
            raise SystemExit(f"reward hub cannot start its worker pool: {exc}") from None
        metrics.watch_pool(pool)
        if "code" in registry:
            await asyncio.to_thread(_log_sandbox, logger)
        await grpc_server.start()
        http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
        stop_task = asyncio.create_task(stop.wait())
        http_port = http_socket.getsockname()[1]  # the one bound, when --port 0 let the system pick
        logger.info("reward hub serving HTTP on %s, gRPC on port %d", host_port(settings.host, http_port), grpc_port)
        await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        logger.info("reward hub stopping")
        stop_task.cancel()
        http.should_exit = True
        grace = settings.shutdown_grace_seconds
        # Requests still scoring when the grace runs out are answered 503 / UNAVAILABLE, just before the servers
        # would cut them off (uvicorn with a 500 and a traceback in the log, gRPC with "Cancelling all calls").
        loop.call_later(max(0.0, grace - _ANSWER_BEFORE_CUTOFF_SECONDS), scorer.stop)
        await asyncio.gather(grpc_server.stop(grace), asyncio.wait_for(http_task, grace + 5))
    finally:
        await pool.close()
        await close_clients()
        http_socket.close()
    logger.info("reward hub stopped")


def _memory_budget(settings: RewardSettings, logger: logging.Logger) -> MemoryBudget | None:
    """The memory the `code` sandbox's tests may hold together (see `sandbox_memory`), logged as each worker's
    share; a limit the hub cannot read stops it, rather than run tests unbounded in a container that has one."""
    from rlfleet_reward.sandbox_memory import memory_budget

    try:
        budget = memory_budget(settings.code_memory_budget_mb, settings.code_memory_reserve_mb, settings.workers)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"reward hub cannot read its container's memory limit: {exc}") from None
    if budget is None:
        logger.info("code sandbox memory: no budget (no container memory limit); a test holds its own limits")
    elif budget.share_mb < _SMALLEST_MEMORY_MB:
        logger.warning(
            "code sandbox memory: %s, below the smallest memory_mb (%d MiB): every code spec will be refused; raise "
            "RLFLEET_REWARD_CODE_MEMORY_BUDGET_MB or the memory limit, or lower RLFLEET_REWARD_CODE_MEMORY_RESERVE_MB "
            "or the workers",
            budget.describe(),
            _SMALLEST_MEMORY_MB,
        )
    else:
        logger.info("code sandbox memory: %s", budget.describe())
    return budget


def _log_sandbox(logger: logging.Logger) -> None:
    from rlfleet_reward.sandbox import probe_isolation

    try:
        logger.info("code sandbox: %s", probe_isolation().describe())
    except RuntimeError as exc:
        logger.error("the code reward function cannot run here: %s", exc)


def main(argv: Sequence[str] | None = None, extra_functions: Mapping[str, RewardFunction] | None = None) -> None:
    """Runs the hub; `extra_functions` adds reward functions beside the entry points (for tests)."""
    settings = settings_from_args(argv)

    import asyncio

    from rlfleet.logs import init_logging
    from rlfleet_reward.registry import Registry

    init_logging("reward", settings.log_level)
    registry = Registry.from_entry_points(extra=extra_functions)
    asyncio.run(serve(settings, registry))


if __name__ == "__main__":
    main()
