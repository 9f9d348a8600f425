"""Races between an engine's restart, its admission and a fleet weight update, each of which left an engine in
routing on weights other than the fleet's, or restarted one that was up:

- the engine recovers while its restart is under way: admitted then, it stayed in routing once the restarter
  replaced the process, the new one serving its boot weights;
- the restarter gives up, but the engine comes up just after: the next attempt killed it, mid-load perhaps;
- the engine answers a fleet load, then dies before the other engines have answered: the load was recorded on it
  all the same, and the process its supervisor started on boot weights rejoined without loading.

In process: a Fleet in front of FakeEngines, whose weights are what they were last told to load.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from router_fakes import FakeEngine, ThreadedServer

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig
from rlfleet_router.fleet import Fleet

LOAD = {"model_path": "/ckpt/step-7", "weight_version": "7"}
FAST_HEALTH = {
    "health_check_interval_secs": 0.1,
    "health_check_timeout_secs": 0.5,
    "health_failure_threshold": 2,
    "health_success_threshold": 1,
}


class ScriptedRestarter:
    """Each restart runs `attempt(url, n)` (n from 1), which may replace the engine's process or raise."""

    def __init__(self, attempt: Callable[[str, int], Any]) -> None:
        self.attempt = attempt
        self.calls = 0

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        self.calls += 1
        await self.attempt(url, self.calls)
        return url

    async def release(self, url: str) -> None:
        pass

    async def close(self) -> None:
        pass


@asynccontextmanager
async def fleet_of(
    engines: list[FakeEngine], restarter: ScriptedRestarter | None = None, **settings: Any
) -> AsyncIterator[Fleet]:
    for engine in engines:
        engine.server = ThreadedServer(engine.app()).start()
    if restarter is not None:  # a real restarter's settings, so the fleet heals; the restarter is then replaced
        settings = {"restarter": "local", "local_engine_command": "engine --port {port}", **settings}
    config = RouterConfig(worker_urls=[e.url for e in engines], **{**FAST_HEALTH, **settings})
    fleet = Fleet(config)
    if restarter is not None:
        assert fleet.healer is not None
        fleet.healer.restarter = restarter
    await fleet.start()
    try:
        async with asyncio.timeout(10):
            while len(fleet.workers.healthy()) < len(engines):
                await asyncio.sleep(0.02)
        yield fleet
    finally:
        await fleet.stop()
        for engine in engines:
            if engine.server is not None:
                await asyncio.to_thread(engine.server.stop)


async def load_version_7(fleet: Fleet) -> str:
    return (
        await fleet.weights.update_fleet(LOAD["model_path"], LOAD["weight_version"], json.dumps(LOAD).encode())
    ).message


def booted(engine: FakeEngine) -> None:
    """The engine's process replaced by a new one, on its boot weights."""
    engine.weight_version, engine.model_path, engine.healthy = "0", "/models/initial", True


def test_an_engine_that_recovers_while_it_is_restarted_rejoins_only_on_the_fleets_weights() -> None:
    engine = FakeEngine(name="a")
    recovered = asyncio.Event()
    replace = asyncio.Event()
    states_during_restart: list[bool] = []

    async def attempt(url: str, n: int) -> None:
        engine.healthy = True  # the old process answers again (a stall that ended)
        recovered.set()
        await replace.wait()  # the restarter's own steps (a container looked up and stopped) take a while
        booted(engine)

    async def scenario() -> None:
        async with fleet_of(
            [engine, FakeEngine(name="b")], ScriptedRestarter(attempt), restart_timeout_secs=5
        ) as fleet:
            assert "2/2" in await load_version_7(fleet)
            worker = fleet.workers.get(engine.url)
            engine.healthy = False
            async with asyncio.timeout(10):
                await recovered.wait()
                for _ in range(10):  # a second of probes the recovered process passes
                    states_during_restart.append(worker.healthy)
                    await asyncio.sleep(0.1)
                replace.set()
                while worker.restarting or not worker.healthy:
                    await asyncio.sleep(0.02)
            assert engine.weight_version == "7" and worker.weight_version == "7", (engine, worker.weight_version)

    asyncio.run(scenario())
    assert not any(states_during_restart), "admitted while the restarter was replacing it"


def test_an_engine_up_after_a_restart_attempt_failed_is_not_restarted_again() -> None:
    engine = FakeEngine(name="a", update_delay=1.0)  # the fleet's weights take a while to load

    async def attempt(url: str, n: int) -> None:
        if n == 1:
            booted(engine)  # a replacement that became ready just after the restarter stopped waiting
            raise Unavailable("no replacement of pod engine-0 became Ready within 120s")

    restarter = ScriptedRestarter(attempt)

    async def scenario() -> None:
        settings = {"restart_timeout_secs": 5, "restart_initial_backoff_secs": 0.3, "restart_max_backoff_secs": 0.3}
        async with fleet_of([engine, FakeEngine(name="b")], restarter, **settings) as fleet:
            await load_version_7(fleet)
            worker = fleet.workers.get(engine.url)
            engine.healthy = False
            async with asyncio.timeout(10):
                while not restarter.calls:
                    await asyncio.sleep(0.02)
                while not worker.healthy:  # through admission, which loads the fleet's weights for a second
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # longer than the backoff: no restart after it
            assert engine.weight_version == "7" and worker.healthy

    asyncio.run(scenario())
    assert restarter.calls == 1


def test_a_load_answered_by_an_engine_that_left_routing_before_the_fan_out_ended_is_not_recorded_on_it() -> None:
    first, slow = FakeEngine(name="first"), FakeEngine(name="slow", update_delay=2.0)

    async def scenario() -> None:
        async with fleet_of([first, slow]) as fleet:
            worker = fleet.workers.get(first.url)
            update = asyncio.create_task(load_version_7(fleet))
            async with asyncio.timeout(10):
                while first.weight_version != "7":
                    await asyncio.sleep(0.01)
                assert first.server is not None
                port = first.server.port
                await asyncio.to_thread(first.server.stop)  # it dies right after it answered
                while worker.healthy:
                    await asyncio.sleep(0.02)
                message = await update
                assert "1/2 engines serve weight version '7'" in message, message
                # Its supervisor (a restart policy, the kubelet) starts it again, on its boot weights.
                booted(first)
                first.server = ThreadedServer(first.app(), port=port).start()
                while not worker.healthy:
                    await asyncio.sleep(0.02)
            assert first.weight_version == "7" and len(first.update_bodies) == 2, first.update_bodies

    asyncio.run(scenario())
