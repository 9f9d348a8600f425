"""Assembles the orchestrator process: clients, run store, core, run queue, REST and gRPC servers on one
event loop, until SIGTERM or SIGINT.

Shutdown stops the queue first (the active run stays RUNNING in Redis and is resumed by the next
orchestrator), ends open watch streams, then the servers, each within a bounded grace period.

The run queue waits out Redis being unavailable and records every run's own failure, so an error that ends it
is a fault: the process then shuts down the same way and exits with status 1, for its supervisor to restart it
(the runs it would drive wait for that); a shutdown asked for by a signal exits with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from rlfleet.api_token import ApiTokenGuard, bearer_headers, read_token_file
from rlfleet.http_head_limit import HeadLimitedHttpProtocol
from rlfleet.sample_stream import connect_redis, connect_redis_async
from rlfleet_rollout.concurrency import cancel_and_wait
from rlfleet_rollout.config import RolloutConfig
from rlfleet_rollout.environment import ReplyPool
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.http_app import build_app, health_client
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.router_client import RouterClient
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_lease import RunLease
from rlfleet_rollout.run_loop import RunDeps
from rlfleet_rollout.run_queue import RunQueue
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore
from rlfleet_rollout.step_producer import STEP_REASONS
from rlfleet_rollout.trainer_client import TrainerClient

logger = logging.getLogger(__name__)

_REDIS_TIMEOUT_S = 10.0
_API_REDIS_CONNECTIONS = 32
"""The Redis connections the Runs API's callers share: a client of their own, whose calls wait for a free one
(within _REDIS_TIMEOUT_S) rather than fail, so that no number of callers takes the run loop's connections (watchers
of a run share one reader of it: run_events.py). On the run loop's client, 150 watchers took all 100 and the
running run failed ("Redis was unreachable")."""


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: this process decides when everything stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: RolloutConfig) -> None:
    metrics = RolloutMetrics()
    token = read_token_file(config.api_token_file)
    guard = ApiTokenGuard(token, metrics.registry, "rollout")
    filters = FilterRegistry.from_entry_points()
    metrics.add_filter_reasons([*STEP_REASONS, *filters.names()])
    rollouts = RolloutRegistry.from_entry_points()
    redis_async = connect_redis_async(config.redis_url, timeout_s=_REDIS_TIMEOUT_S)
    redis_api = connect_redis_async(
        config.redis_url, timeout_s=_REDIS_TIMEOUT_S, max_connections=_API_REDIS_CONNECTIONS
    )
    redis_sync = connect_redis(config.redis_url, timeout_s=_REDIS_TIMEOUT_S)
    redis_health = health_client(config.redis_url)
    # The fleet's one token also opens the router's admin endpoints (aborts) to this client.
    http = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max(16, 2 * config.max_concurrent_generations)),
        headers=bearer_headers(token),
    )
    trainer = TrainerClient(
        config.trainer_address,
        call_timeout_s=config.trainer_call_timeout_s,
        start_timeout_s=config.trainer_start_timeout_s,
    )
    reward = RewardClient(
        http,
        config.reward_url,
        score_timeout_s=config.score_timeout_s,
        validate_timeout_s=config.reward_list_timeout_s,
    )
    core = RunsCore(
        RunStore(redis_async, config.redis_prefix),
        reward,
        RunNotifier(),
        metrics,
        filters=filters,
        rollouts=rollouts,
        poll_interval_s=config.poll_interval_s,
        run_data_retention_s=config.run_data_retention_s,
        data_roots=config.data_roots,
        api_store=RunStore(redis_api, config.redis_prefix),
    )
    replies = ReplyPool(config.env_reply_threads, config.env_reply_timeout_s)
    deps = RunDeps(
        core=core,
        trainer=trainer,
        router=RouterClient(http, config.router_url, timeout_s=config.generate_timeout_s),
        reward=reward,
        redis=redis_sync,
        config=config,
        metrics=metrics,
        filters=filters,
        rollouts=rollouts,
        replies=replies,
    )

    grpc_server, grpc_port = build_grpc_server(
        core, config.host, config.grpc_port, guard, keepalive_s=config.grpc_keepalive_s
    )
    web = _EmbeddedUvicorn(
        uvicorn.Config(
            build_app(core, metrics, redis_health, guard, watch_keepalive_s=config.watch_keepalive_s),
            host=config.host,
            port=config.port,
            log_config=None,
            http=HeadLimitedHttpProtocol,
            timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)),
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await grpc_server.start()
    lease = RunLease(redis_async, config.redis_prefix, ttl_s=config.run_lease_s)
    counts_task = asyncio.create_task(core.run_counts.serve(), name="run counts")
    queue_task = asyncio.create_task(RunQueue(deps, lease).serve(), name="run queue")
    web_task = asyncio.create_task(web.serve(), name="http")
    logger.info(
        "orchestrator %s serving HTTP on %s:%d and gRPC on port %d", lease.token, config.host, config.port, grpc_port
    )
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({stop_task, queue_task, web_task}, return_when=asyncio.FIRST_COMPLETED)
    for task in done - {stop_task}:
        _log_failure(task)
    logger.info("shutting down")
    try:
        await cancel_and_wait(queue_task, within_s=config.trainer_call_timeout_s + config.shutdown_grace_s)
        await cancel_and_wait(counts_task, within_s=config.shutdown_grace_s)
        core.close()
        web.should_exit = True
        await grpc_server.stop(grace=config.shutdown_grace_s)
        await asyncio.wait({web_task}, timeout=config.shutdown_grace_s + 5)
    finally:
        stop_task.cancel()
        await http.aclose()
        await trainer.close()
        await redis_async.aclose()
        await redis_api.aclose()
        await redis_health.aclose()
        redis_sync.close()
        replies.close()
    if queue_task not in done:
        _log_failure(queue_task)  # it may fail as it is stopped
    if _failure(queue_task) is not None:
        logger.error("stopped after the run queue failed; exit status 1")
        raise SystemExit(1)
    logger.info("stopped")


def _failure(task: asyncio.Task[Any]) -> BaseException | None:
    """The error that ended `task`, if one did (not a cancellation)."""
    return task.exception() if task.done() and not task.cancelled() else None


def _log_failure(task: asyncio.Task[Any]) -> None:
    failure = _failure(task)
    if failure is not None:
        logger.error("%s stopped: %s: %s", task.get_name(), type(failure).__name__, failure, exc_info=failure)
