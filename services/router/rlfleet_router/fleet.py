"""The router's transport-free core: the fleet of engines and everything that acts on it.

`Fleet` wires one worker registry, routing policy, proxy, weight state, health checker, control
fan-out, trajectory cache, metrics registry and, when configured, a restarter (self-healing) and
Kubernetes discovery around one HTTP client to the engines (the proxy relays generation traffic
over its own, leaner one). The HTTP app is a thin layer over it; tests and other front ends (a gRPC
one) use the same object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping

import httpx
from starlette.responses import Response

from rlfleet.errors import InvalidInput
from rlfleet.http_errors import is_json_media_type
from rlfleet_router.abort_answers import aborted_answer
from rlfleet_router.busy_engines import LOADING
from rlfleet_router.chars_per_token import CharsPerToken
from rlfleet_router.config import RouterConfig
from rlfleet_router.distributed_weights import DistributedWeights
from rlfleet_router.engine_aborts import request_rids
from rlfleet_router.engine_response import MAX_CAPTURED_BYTES
from rlfleet_router.fanout import Fanout
from rlfleet_router.fleet_pause import FleetPause
from rlfleet_router.health import HealthChecker
from rlfleet_router.held_requests import RequestAborted
from rlfleet_router.http_deadline import DeadlineTransport
from rlfleet_router.kubernetes_api import KubernetesAPI
from rlfleet_router.kubernetes_discovery import KubernetesDiscovery
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.openai_routing import routing_body
from rlfleet_router.policies import CacheAware, RoutingRequest, create_policy
from rlfleet_router.prefill_stagger import PrefillStagger
from rlfleet_router.proxy import Proxy, RetryPolicy
from rlfleet_router.restarters import create_restarter
from rlfleet_router.self_healing import Healer
from rlfleet_router.trajectory_capture import check_trajectory_request, trajectory_id, turn_from_answer
from rlfleet_router.trajectory_store import TrajectoryStore
from rlfleet_router.weights import FleetWeights
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


class Fleet:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_secs, connect=config.connect_timeout_secs),
            # Streams stay open for a whole generation: a pool cap would queue requests behind them. Engines sit on
            # the cluster network; a proxy from the environment must not intercept them.
            transport=DeadlineTransport(
                httpx.AsyncHTTPTransport(
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=256), trust_env=False
                )
            ),
            trust_env=False,
        )
        self.workers = WorkerRegistry(config.health_failure_threshold, config.health_success_threshold)
        self.metrics = RouterMetrics(self.workers, lambda: self.weights.version)
        self.policy = create_policy(config.policy, config.policy_options())
        if isinstance(self.policy, CacheAware):
            self.metrics.fleet.tree = self.policy.tree
        # A weight load or a flush empties an engine's prefix cache: the policy must not route by what it held.
        self.weights = FleetWeights(
            self.client,
            self.workers,
            config.weight_update_timeout_secs,
            self.metrics,
            self.policy.forget_caches,
            info_timeout_secs=config.health_check_timeout_secs,
            rejoin=lambda workers: self.health.admission.rejoin(workers),
            # Trajectories too many versions old to train on are dropped as the fleet moves on.
            on_new_version=lambda updates: self.trajectories.evict_stale(updates),
        )
        self.pauses = FleetPause(self.client, self.weights.busy, config.control_timeout_secs)
        self.workers.on_may_have_restarted = self.pauses.may_have_restarted
        self.distributed_weights = DistributedWeights(
            self.client, self.workers, self.weights, config.health_check_timeout_secs
        )
        self.health = HealthChecker(
            self.client,
            self.workers,
            self.weights,
            self.pauses,
            endpoint=config.health_check_endpoint,
            interval_secs=config.health_check_interval_secs,
            timeout_secs=config.health_check_timeout_secs,
            on_pause_expired=lambda workers: self.fanout.end_pauses(workers),
            metrics=self.metrics,
        )
        retry = RetryPolicy(
            max_retries=0 if config.disable_retries else config.retry_max_retries,
            initial_backoff_secs=config.retry_initial_backoff_ms / 1000,
            max_backoff_secs=config.retry_max_backoff_ms / 1000,
            multiplier=config.retry_backoff_multiplier,
        )
        self.chars_per_token = CharsPerToken()
        self.metrics.fleet.chars_per_token = self.chars_per_token
        # Only cache_aware sends a prompt's repeats to its engine by design (a GRPO group as one unit).
        stagger_ms = config.prefill_stagger_ms if isinstance(self.policy, CacheAware) else 0.0
        self.prefill_stagger = PrefillStagger(stagger_ms / 1000)
        self.proxy = Proxy(
            self.workers,
            self.policy,
            self.metrics,
            retry,
            self.chars_per_token,
            request_timeout_secs=config.request_timeout_secs,
            connect_timeout_secs=config.connect_timeout_secs,
            max_whole_answer_bytes=config.max_whole_answer_bytes,
            prefill_stagger=self.prefill_stagger,
        )
        self.workers.on_failed_requests = self.proxy.engine_failed
        self.fanout = Fanout(
            self.client,
            self.workers,
            config.control_timeout_secs,
            self.policy.forget_caches,
            self.pauses,
            before_continue=self.weights.before_continue,
            drop_requests=self.proxy.drop_requests,
            expired_pauses=self.metrics.expired_pauses,
            abort_held=self.proxy.held.abort,
        )
        self.trajectories = TrajectoryStore(config.trajectory_max_tokens, config.trajectory_max_update_lag)
        self.metrics.fleet.trajectories = self.trajectories
        self.healer: Healer | None = None
        if config.restarter is not None:
            self.healer = Healer(
                create_restarter(config.restarter, config),
                self.workers,
                self.policy,
                self.metrics,
                timeout_secs=config.restart_timeout_secs,
                initial_backoff_secs=config.restart_initial_backoff_secs,
                max_backoff_secs=config.restart_max_backoff_secs,
                loading=lambda worker: self.weights.busy.reason(worker) == LOADING,
                remove=lambda worker: self.remove_worker(worker.id),
            )
            self.workers.on_failed = self.healer.on_failed
        self.discovery: KubernetesDiscovery | None = None
        if config.kubernetes_discovery:
            self.discovery = KubernetesDiscovery(
                KubernetesAPI.from_config(config),
                config.kubernetes_label_selector,
                config.kubernetes_engine_port,
                config.kubernetes_discovery_interval_secs,
                self.workers,
                self.add_worker,
                self.remove_worker,
                gone_after_secs=config.restart_timeout_secs,
            )
        for url in config.worker_urls:
            worker, _ = self.workers.add(url)
            self.metrics.add_engine(worker.url)

    async def start(self) -> None:
        await self.proxy.start()
        if self.healer is not None:
            for url in await self.healer.restarter.start():
                self.add_worker(url)
        self.health.start()
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        await self.distributed_weights.stop()
        if self.healer is not None:
            await self.healer.stop()
        await self.proxy.stop()
        await self.client.aclose()

    async def generate(
        self,
        route: str,
        body: bytes,
        headers: Mapping[str, str],
        arrived_at: float | None = None,
        client_gone: asyncio.Future[None] | None = None,
    ) -> Response:
        """Routes a generation request (/generate or OpenAI); records its turn if it belongs to a trajectory.

        `client_gone`, done once the client has left, gives the request up (`Proxy.forward`). A request a client's
        /abort_request named before it reached an engine is answered as aborted (`abort_answers`).
        """
        parsed = parse_json_object(body)
        if not is_json_media_type(headers.get("content-type", "")):
            # The body is a JSON object whatever the client called it (`curl -d` calls it form data), and an
            # engine reads it as one only under a JSON Content-Type.
            headers = {**headers, "content-type": "application/json"}
        routing = RoutingRequest(route, routing_body(route, parsed), self.chars_per_token.value)
        trajectory = trajectory_id(headers)
        on_answer = None
        if trajectory is not None:
            check_trajectory_request(route, parsed)

            def on_answer(answer: bytes | None, worker: Worker) -> None:
                if answer is None:
                    lost(worker, f"an answer in pieces over {MAX_CAPTURED_BYTES >> 20} MiB is relayed but not read")
                    return
                try:
                    turn = turn_from_answer(route, parsed, answer, worker.url, worker.weight_version)
                except ValueError as exc:
                    lost(worker, str(exc))
                    return
                self.trajectories.record(trajectory, turn, self.weights.updates)

            def lost(worker: Worker, reason: str) -> None:
                logger.warning("answer of %s for trajectory %s not recorded: %s", worker.url, trajectory, reason)
                rid = parsed.get("rid")
                self.trajectories.record_lost(
                    trajectory, rid if isinstance(rid, str) else None, worker.url, reason, self.weights.updates
                )

        started = arrived_at if arrived_at is not None else time.perf_counter()
        try:
            return await self.proxy.forward(
                routing,
                body,
                headers,
                arrived_at=started,
                on_answer=on_answer,
                client_gone=client_gone,
                rids=request_rids(parsed),
            )
        except RequestAborted as exc:
            self.metrics.aborted_unsent.inc()
            logger.info("%s answered as aborted: %s", route, exc)
            return aborted_answer(route, parsed)

    def add_worker(self, url: str) -> tuple[Worker, bool]:
        """Registers `url` (pending until a probe succeeds and it serves the fleet's weights).

        Returns the worker and whether it is new; a known URL keeps its id and state.
        """
        worker, created = self.workers.add(url)
        if created:
            self.metrics.add_engine(worker.url)
            self.health.check_soon(worker)
        return worker, created

    def remove_worker(self, key: str) -> Worker:
        """Out of the fleet at once; requests already at the engine finish there. A restart of it under way stops,
        and the engine that restart started is stopped."""
        worker = self.workers.remove(key)
        if self.healer is not None:
            self.healer.forget(worker)
        self.pauses.removed(worker)
        self.policy.forget(worker)
        self.prefill_stagger.forget(worker.id)
        self.metrics.forget_engine(worker.url)
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


def parse_json_object(body: bytes) -> dict[str, object]:
    try:
        parsed = json.loads(body)
    except ValueError as exc:  # malformed, not UTF-8, or an integer of over 4300 digits
        raise InvalidInput(f"body: not valid JSON ({exc})") from exc
    except RecursionError:  # Python's parser recurses once per level, within the interpreter's stack bound
        raise InvalidInput("body: nested too deeply to read (arrays or objects over about 1000 levels)") from None
    if not isinstance(parsed, dict):
        raise InvalidInput(f"body: must be a JSON object, got {type(parsed).__name__}")
    return parsed
