"""While it waits for groups, the trainer keeps the fleet on the run's weight version: a router that restarted
(and so knows no version, admitting every engine on what it reports) is loaded with it again."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from engine_fleet import start_engine_fleet  # noqa: E402

from rlfleet.processes import free_port  # noqa: E402
from rlfleet_trainer.fleet_version import FleetVersionCheck  # noqa: E402
from rlfleet_trainer.metrics import TrainerMetrics  # noqa: E402
from rlfleet_trainer.router_client import RouterClient  # noqa: E402

INTERVAL_S = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_at(version: int, weights_path: str, weights_version: int | None = None) -> Any:
    """A run at weight version `version` whose Status names `weights_path`, of `weights_version` (by default the
    run's version: its directory is complete)."""
    on_disk = version if weights_version is None else weights_version
    return SimpleNamespace(run_id="run", weight_version=version, weights_path=weights_path, weights_version=on_disk)


def served(engine_url: str) -> object:
    return httpx.get(f"{engine_url}/get_weight_version", timeout=5.0).json()["weight_version"]


def reloads(metrics: TrainerMetrics) -> float:
    return metrics.registry.get_sample_value("rlfleet_trainer_fleet_reloads_total") or 0.0


def test_a_router_that_forgot_the_version_is_loaded_with_the_runs_once_per_interval(fake_router: Any) -> None:
    clock, metrics = Clock(), TrainerMetrics()
    check = FleetVersionCheck(RouterClient(fake_router.url, 10.0), INTERVAL_S, metrics, clock)
    run = run_at(3, "/weights/v3")
    check(run)
    assert fake_router.loads == [], "asked before an interval had passed"
    clock.now += INTERVAL_S
    check(run)  # the fake router has loaded nothing: it reports no version, as a restarted router does
    assert fake_router.loads == [{"model_path": "/weights/v3", "weight_version": "3"}]
    assert reloads(metrics) == 1
    check(run)
    clock.now += INTERVAL_S
    check(run)  # it serves version 3 now
    assert len(fake_router.loads) == 1 and reloads(metrics) == 1


def test_a_router_on_another_version_is_brought_back_to_the_runs(fake_router: Any) -> None:
    clock, metrics = Clock(), TrainerMetrics()
    router = RouterClient(fake_router.url, 10.0)
    router.load_weights("/elsewhere/v7", 7)
    check = FleetVersionCheck(router, INTERVAL_S, metrics, clock)
    clock.now += INTERVAL_S
    check(run_at(2, "/weights/v2"))
    assert fake_router.loads[-1] == {"model_path": "/weights/v2", "weight_version": "2"}


def test_a_version_whose_directory_is_not_complete_is_not_loaded(fake_router: Any) -> None:
    """Its disk copy is being written (it registers the version itself) or failed: the directory the run names
    holds an earlier version, which must not reach the engines labelled as the run's."""
    clock, metrics = Clock(), TrainerMetrics()
    check = FleetVersionCheck(RouterClient(fake_router.url, 10.0), INTERVAL_S, metrics, clock)
    clock.now += INTERVAL_S
    check(run_at(4, "/weights/v3", weights_version=3))
    assert fake_router.loads == [] and reloads(metrics) == 0
    check(run_at(4, "/weights/v4"))
    assert fake_router.loads == [{"model_path": "/weights/v4", "weight_version": "4"}]


def test_a_router_that_does_not_answer_is_asked_again_later_and_the_wait_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, metrics = Clock(), TrainerMetrics()
    check = FleetVersionCheck(RouterClient(f"http://127.0.0.1:{free_port()}", 10.0), INTERVAL_S, metrics, clock)
    clock.now += INTERVAL_S
    check(run_at(1, "/weights/v1"))
    assert "could not ask the router which weight version the fleet serves" in caplog.text
    assert reloads(metrics) == 0


def test_an_interval_of_0_never_asks(fake_router: Any) -> None:
    clock = Clock()
    check = FleetVersionCheck(RouterClient(fake_router.url, 10.0), 0.0, TrainerMetrics(), clock)
    clock.now += 10 * INTERVAL_S
    check(run_at(3, "/weights/v3"))
    assert fake_router.loads == []


@pytest.mark.e2e
def test_a_restarted_router_and_an_engine_that_restarted_meanwhile_are_brought_to_the_runs_version(
    small_model_dir: Path, tmp_path: Path
) -> None:
    fleet = start_engine_fleet(small_model_dir, tmp_path / "logs")
    try:
        v1 = shutil.copytree(small_model_dir, tmp_path / "v1")
        router = RouterClient(fleet.router_url, 30.0)
        router.load_weights(str(v1), 1)
        fleet.router.stop()
        fleet.restart_engine(1)  # back on its boot weights, version 0, while no router watched
        fleet.restart_router()
        fleet.wait_healthy_engines(2)
        # The restarted router admits each engine on what it reports.
        assert [served(url) for url in fleet.engine_urls] == ["1", "0"]
        assert router.served_version(5.0) is None

        clock, metrics = Clock(), TrainerMetrics()
        check = FleetVersionCheck(router, INTERVAL_S, metrics, clock)
        clock.now += INTERVAL_S
        check(run_at(1, str(v1)))

        assert router.served_version(5.0) == "1"
        for url in fleet.engine_urls:
            info = httpx.get(f"{url}/get_model_info", timeout=5.0).json()
            assert (info["weight_version"], info["model_path"]) == ("1", str(v1)), url
        assert reloads(metrics) == 1
    finally:
        fleet.stop()
