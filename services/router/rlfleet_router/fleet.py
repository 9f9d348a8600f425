"""The router's transport-free core: the fleet of engines and everything that acts on it.

`Fleet` wires one worker registry, routing policy, proxy, weight state, health checker and
metrics registry around one HTTP client to the engines. The HTTP app is a thin layer over it;
tests and other front ends (an OpenAI-compatible one, a gRPC one) use the same object.
"""

from __future__ import annotations

import logging

import httpx

from rlfleet_router.config import RouterConfig
from rlfleet_router.health import HealthChecker
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import CacheAware, create_policy
from rlfleet_router.proxy import Proxy, RetryPolicy
from rlfleet_router.weights import FleetWeights
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


class Fleet:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_secs, connect=config.connect_timeout_secs),
            # Streams stay open for a whole generation: a pool cap would queue requests behind them.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            # Engines sit on the cluster network; a proxy from the environment must not intercept them.
            trust_env=False,
        )
        self.workers = WorkerRegistry(config.health_failure_threshold, config.health_success_threshold)
        self.metrics = RouterMetrics(self.workers, lambda: self.weights.version)
        self.weights = FleetWeights(self.client, self.workers, config.weight_update_timeout_secs, self.metrics)
        self.health = HealthChecker(
            self.client,
            self.workers,
            self.weights,
            endpoint=config.health_check_endpoint,
            interval_secs=config.health_check_interval_secs,
            timeout_secs=config.health_check_timeout_secs,
        )
        retry = RetryPolicy(
            max_retries=0 if config.disable_retries else config.retry_max_retries,
            initial_backoff_secs=config.retry_initial_backoff_ms / 1000,
            max_backoff_secs=config.retry_max_backoff_ms / 1000,
            multiplier=config.retry_backoff_multiplier,
        )
        self.policy = create_policy(config.policy, config.policy_options())
        if isinstance(self.policy, CacheAware):
            self.metrics.fleet.tree = self.policy.tree
        self.proxy = Proxy(
            self.client,
            self.workers,
            self.policy,
            self.metrics,
            retry,
            request_timeout_secs=config.request_timeout_secs,
            connect_timeout_secs=config.connect_timeout_secs,
        )
        for url in config.worker_urls:
            self.workers.add(url)

    async def start(self) -> None:
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await self.client.aclose()

    def add_worker(self, url: str) -> tuple[Worker, bool]:
        """Registers `url` (pending until a probe succeeds and it serves the fleet's weights).

        Returns the worker and whether it is new; a known URL keeps its id and state.
        """
        worker, created = self.workers.add(url)
        if created:
            self.health.check_soon(worker)
        return worker, created

    def remove_worker(self, key: str) -> Worker:
        """Out of the fleet at once; requests already at the engine finish there."""
        worker = self.workers.remove(key)
        self.policy.forget(worker)
        return worker

    def describe(self) -> dict[str, object]:
        target = self.weights.target
        workers = self.workers.all()
        return {
            "weight_version": target.version if target else None,
            "model_path": target.model_path if target else None,
            "policy": self.config.policy,
            "healthy": sum(w.healthy for w in workers),
            "total": len(workers),
            "workers": [w.describe() for w in workers],
        }
