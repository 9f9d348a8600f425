"""`EngineMetrics` alone, on a fake clock: what both backends export, without a process or a model."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from rlfleet_engine.metrics import EngineMetrics

LABELS = {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


def decode_for_2_s(metrics: EngineMetrics, clock: FakeClock) -> None:
    """A step of 4 tokens every 0.1 s, from t to t + 2 s: 40 tokens/s, with the clock left at the last step."""
    for step in range(21):
        if step:
            clock.now += 0.1
        metrics.observe_generated(4)


def scraper(registry: CollectorRegistry) -> Callable[[], float | None]:
    return lambda: registry.get_sample_value("sglang:gen_throughput", LABELS)


def test_gen_throughput_falls_to_0_once_the_engine_is_idle(clock: FakeClock) -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    decode_for_2_s(metrics, clock)
    # No decode step runs on an idle engine, so nothing but the scrape itself can bring the gauge down.
    clock.now += 11.0
    assert scraper(registry)() == 0.0
    assert metrics.last_gen_throughput == 0.0


def test_gen_throughput_counts_the_tokens_of_the_last_5_s(clock: FakeClock) -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    scraped = scraper(registry)
    assert scraped() == 0.0
    decode_for_2_s(metrics, clock)
    assert scraped() == pytest.approx(40.0), "80 tokens made after the first step of the window, in 2 s"
    assert metrics.last_gen_throughput == pytest.approx(40.0)
    clock.now += 2.0
    assert scraped() == pytest.approx(80 / 4.0), "idle seconds inside the window count"
    clock.now += 2.45
    # The steps before t + 1.45 s have left the window; the one at t + 1.5 s starts it.
    assert scraped() == pytest.approx(5 * 4 / 4.95)
