"""The engine's Prometheus metrics, under SGLang's names and labels so SGLang dashboards read them.

Scheduler gauges carry SGLang's scheduler labels (model_name, engine_type, tp_rank, pp_rank);
request counters and latency histograms carry the tokenizer-side label (model_name). The one
metric SGLang has no name for, the size of each decode batch, is ours: rlfleet_engine_decode_batch_size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from rlfleet_engine.generation_job import GenerationJob

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 15, 20, 30, 60)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 1, 2)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds of history behind sglang:gen_throughput.
_THROUGHPUT_WINDOW_S = 5.0


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        req = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=list(sched), registry=registry).labels(**sched)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        # Computed when scraped, so it falls to 0 once the engine stops generating (no decode step would set it).
        self.gen_throughput.set_function(self.windowed_gen_throughput)
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labelnames=list(req), registry=registry
        ).labels(**req)
        self.generation_tokens = Counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            labelnames=list(req),
            registry=registry,
        ).labels(**req)
        self.cached_tokens = Counter(
            "sglang:cached_tokens", "Number of cached prompt tokens.", labelnames=list(req), registry=registry
        ).labels(**req)
        self.num_requests = Counter(
            "sglang:num_requests", "The number of processed requests.", labelnames=list(req), registry=registry
        ).labels(**req)
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=list(req),
            buckets=_TTFT_BUCKETS,
            registry=registry,
        ).labels(**req)
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            labelnames=list(req),
            buckets=_E2E_BUCKETS,
            registry=registry,
        ).labels(**req)
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labelnames=list(req),
            buckets=_ITL_BUCKETS,
            registry=registry,
        ).labels(**req)
        self.decode_batch_size = Histogram(
            "rlfleet_engine_decode_batch_size",
            "Sequences advanced together by one decode step.",
            labelnames=list(req),
            buckets=_BATCH_BUCKETS,
            registry=registry,
        ).labels(**req)
        self.cache_hit_rate.set(0.0)
        # (monotonic time, tokens) of each step in the last window. The scheduler thread appends while a scrape
        # reads, so both hold the lock.
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_lock = threading.Lock()

    def observe_generated(self, tokens: int) -> None:
        """Counts `tokens` new output tokens, made by one step now, for the counter and the windowed throughput."""
        now = time.monotonic()
        self.generation_tokens.inc(tokens)
        with self._recent_lock:
            self._recent.append((now, tokens))
            self._trim(now)

    def windowed_gen_throughput(self) -> float:
        """Output tokens/s over the last `_THROUGHPUT_WINDOW_S` (or since the oldest step in it, if more recent).

        The oldest step's tokens were made before its timestamp, so they only mark where the span starts; a lone
        step counts over the whole window. 0 once no step is left in the window.
        """
        now = time.monotonic()
        with self._recent_lock:
            self._trim(now)
            recent = list(self._recent)
        if not recent:
            return 0.0
        if len(recent) == 1:
            return recent[0][1] / _THROUGHPUT_WINDOW_S
        return sum(n for _, n in recent[1:]) / max(now - recent[0][0], 1e-3)

    @property
    def last_gen_throughput(self) -> float:
        """What `sglang:gen_throughput` reads now (`/get_server_info` reports it too)."""
        return self.windowed_gen_throughput()

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > _THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def observe_token_gaps(self, jobs: Iterable[GenerationJob]) -> None:
        """Before a step appends a token to each of `jobs`: the inter-token latency, one observation per token as
        SGLang counts it (the time since the job's previous token), so a stall (a pause, a weight load) shows in
        the tail rather than averaged into the request's mean."""
        now = time.monotonic()
        for job in jobs:
            if job.log_metrics and job.last_token_at is not None:
                self.inter_token_latency.observe(now - job.last_token_at)

    def observe_finished(self, job: GenerationJob) -> None:
        """A finished job's request count, time to first token and end-to-end latency."""
        e2e = (job.finished_at or time.monotonic()) - job.created_at
        self.num_requests.inc()
        if job.first_token_at is not None:
            self.time_to_first_token.observe(job.first_token_at - job.created_at)
        self.e2e_request_latency.observe(e2e)
