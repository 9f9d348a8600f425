"""Routing policies and the worker registry's state rules, without any network."""

from __future__ import annotations

import pytest

from rlfleet.errors import InvalidInput, NotFound
from rlfleet_router.policies import LeastLoad, RoundRobin, RoutingRequest, available_policies, create_policy
from rlfleet_router.workers import Worker, WorkerRegistry, WorkerState, normalize_worker_url

REQUEST = RoutingRequest(route="/generate", body={"text": "1+1="})


def make_workers(*in_flight: int) -> list[Worker]:
    return [Worker(url=f"http://127.0.0.1:{9000 + i}", in_flight=n) for i, n in enumerate(in_flight)]


def test_least_load_picks_fewest_in_flight() -> None:
    workers = make_workers(3, 1, 2)
    assert LeastLoad().select(workers, REQUEST) is workers[1]


def test_least_load_rotates_among_ties() -> None:
    workers = make_workers(0, 5, 0)
    policy = LeastLoad()
    picks = [policy.select(workers, REQUEST) for _ in range(4)]
    assert picks == [workers[0], workers[2], workers[0], workers[2]]


def test_least_load_follows_load_as_it_changes() -> None:
    workers = make_workers(0, 0)
    policy = LeastLoad()
    for _ in range(6):
        policy.select(workers, REQUEST).in_flight += 1
    assert [w.in_flight for w in workers] == [3, 3]


def test_round_robin_cycles_regardless_of_load() -> None:
    workers = make_workers(10, 0, 0)
    policy = RoundRobin()
    assert [policy.select(workers, REQUEST) for _ in range(4)] == [workers[0], workers[1], workers[2], workers[0]]


def test_registry_by_name_and_unknown_name_lists_known_ones() -> None:
    assert {"least_load", "round_robin"} <= set(available_policies())
    assert isinstance(create_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="known policies: least_load, round_robin"):
        create_policy("cache_awarre")


def test_new_worker_is_admitted_after_one_success_a_returning_one_after_threshold() -> None:
    registry = WorkerRegistry(failure_threshold=2, success_threshold=3)
    worker, created = registry.add("http://127.0.0.1:9000/")
    assert created and worker.url == "http://127.0.0.1:9000" and worker.state is WorkerState.PENDING
    registry.record_success(worker)
    assert registry.ready_to_admit(worker)
    registry.admit(worker)
    assert registry.healthy() == [worker]

    registry.record_failure(worker, "boom")
    assert worker.healthy, "one failure is below the threshold"
    registry.record_failure(worker, "boom")
    assert worker.state is WorkerState.UNHEALTHY and registry.healthy() == []

    registry.record_success(worker)
    registry.record_success(worker)
    assert not registry.ready_to_admit(worker)
    registry.record_success(worker)
    assert registry.ready_to_admit(worker)


def test_registry_finds_by_id_or_url_and_keeps_one_entry_per_url() -> None:
    registry = WorkerRegistry(failure_threshold=1, success_threshold=1)
    worker, _ = registry.add("http://127.0.0.1:9000")
    again, created = registry.add("http://127.0.0.1:9000/")
    assert again is worker and not created
    assert registry.get(worker.id) is worker
    assert registry.get("http://127.0.0.1:9000") is worker
    assert registry.remove("http://127.0.0.1:9000/") is worker
    with pytest.raises(NotFound):
        registry.get(worker.id)


@pytest.mark.parametrize(
    "url",
    ["", "127.0.0.1:9000", "ftp://host:1", "http://", "http://host:99999", "http://host:1/generate", "http://h:1?x=1"],
)
def test_bad_worker_urls_are_rejected(url: str) -> None:
    with pytest.raises(InvalidInput, match="url"):
        normalize_worker_url(url)
