"""The routing replay's clients: a client sends its next request only after its answer has left the
router's in-flight count, so the answers of one engine step all leave it first, as in the benchmark."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from router_policy_replay import CONCURRENCY, TotalAwareModel, bench_engine_config, replay  # noqa: E402
from router_vs_sglang_router import BALANCE_TARGET, CACHES, Workload, grpo_workload  # noqa: E402

from rlfleet_router.policies import CacheAware, Choice, LeastLoad, RoundRobin, RoutingRequest  # noqa: E402
from rlfleet_router.workers import Worker  # noqa: E402


class CountingRoundRobin(RoundRobin):
    """Round robin that records the fleet's requests in flight each time it routes one."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight_seen: list[int] = []

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        self.in_flight_seen.append(sum(w.in_flight for w in workers))
        return super().select(workers, request)


class LeastLoadOnOneEngine(LeastLoad):
    """Any policy but cache_aware: the router holds nothing back."""


def test_the_answers_of_one_engine_step_leave_the_count_before_the_next_requests_are_routed() -> None:
    workload = grpo_workload(seed=0, scale=0.1)
    policy = CountingRoundRobin()
    result = replay(policy, 4, bench_engine_config(CACHES["roomy"]), workload, seed=0)
    assert sum(result.per_engine) == workload.requests
    first, later = policy.in_flight_seen[:CONCURRENCY], policy.in_flight_seen[CONCURRENCY:]
    assert first == list(range(CONCURRENCY))  # every client's first request, before any answer
    assert later and max(later) == CONCURRENCY - 1  # a client's next request replaces its own answered one
    # A GRPO group's samples finish in the same engine step; their clients' next requests see them all gone.
    assert min(later) <= CONCURRENCY - workload.samples


def test_the_total_aware_reference_keeps_every_engine_within_the_balance_target_of_the_run() -> None:
    workload, engines = grpo_workload(seed=1, scale=0.5), 8
    policy = TotalAwareModel()
    policy.expect(workload, engines)
    result = replay(policy, engines, bench_engine_config(CACHES["roomy"]), workload, seed=1)
    assert sum(result.per_engine) == workload.requests
    assert max(result.per_engine) <= int(BALANCE_TARGET * workload.requests / engines)
    assert result.hit_rate > 0.9  # families stay on the engines holding them


def test_requests_one_iteration_admits_share_no_prefill_unless_the_stagger_holds_repeats_back() -> None:
    """As on the sim engine, each request is a prefill group of its own: samples of one prompt that reach an engine
    during an iteration are admitted together in the next and each computes the prompt. The replay shared it
    among them, which made sglang-router's model reach hit rates the engine never gives. cache_aware's repeats,
    held back by the router's stagger, come after their first's prefill and find the prompt cached."""
    # A short prompt's first request starts the idle engine's (short) iteration; the other 15 arrive during it.
    workload = Workload("grpo", ["y" * 16, "x" * 1600], [], samples=8, max_new_tokens=4)
    config = bench_engine_config(CACHES["roomy"])
    together = replay(LeastLoadOnOneEngine(), 1, config, workload, seed=0)
    staggered = replay(CacheAware(), 1, config, workload, seed=0)
    assert together.hit_rate < 0.05, "the 8 x's admitted together compute it 8 times"
    assert staggered.hit_rate > 0.8, "x's first computes it, its 7 repeats find it cached"
