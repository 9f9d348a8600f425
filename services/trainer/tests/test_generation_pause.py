"""The end of a fleet-wide pause: /continue_generation retried until no engine in routing is left paused, and
sent again when a run starts (a trainer that died mid-pause could not send it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_broadcast import WeightBroadcaster

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import spec_for  # noqa: E402


def paused(router_url: str, bound_s: float = 30.0) -> Any:
    """The pause a version in several buckets travels under."""
    return WeightBroadcaster(RouterClient(router_url, bound_s), "127.0.0.1", "gloo", 1.0, 1.0).engines_paused()


@pytest.mark.parametrize(
    ("answers", "engine_state", "calls"),
    [
        ([503, 503], "healthy", 3),  # the router itself failed (restarting): sent again until it fans it out
        ([502], "healthy", 2),  # an engine in routing did not take it: it would stay paused
        ([502], "unhealthy", 1),  # the engine that did not take it is out of routing: the router's to bring back
    ],
)
def test_a_continue_that_did_not_reach_the_engines_is_sent_again(
    fake_router: Any, answers: list[int], engine_state: str, calls: int
) -> None:
    fake_router.continue_answers = list(answers)
    fake_router.engine_state = engine_state
    with paused(fake_router.url):
        assert fake_router.calls == ["/pause_generation"]
    assert fake_router.calls[1:] == ["/continue_generation"] * calls


def test_retrying_the_continue_is_bounded(fake_router: Any) -> None:
    fake_router.continue_answers = [503] * 100
    started = time.monotonic()
    with paused(fake_router.url, bound_s=2.0):
        pass
    assert time.monotonic() - started < 4.0 and fake_router.calls.count("/continue_generation") >= 2


def test_starting_a_run_resumes_generation_once_its_version_is_loaded(
    core: Any, small_model_dir: Path, fake_router: Any
) -> None:
    core.start_run("paused-fleet", spec_for(small_model_dir, steps=1, groups_per_step=1))
    assert fake_router.calls == ["/update_weights_from_disk", "/continue_generation"]


@pytest.mark.parametrize(("abort_all_requests", "mode"), [(False, "retract"), (True, "abort")])
def test_the_pause_holds_generations_in_flight_unless_the_run_resumes_them(
    fake_router: Any, abort_all_requests: bool, mode: str
) -> None:
    """SGLang's default mode aborts every generation in flight: under rollout.on_weight_update "finish" they would
    all be lost. "retract" holds them; "abort" only for "abort_resume", which resumes them on the new version."""
    router = RouterClient(fake_router.url, 30.0)
    broadcaster = WeightBroadcaster(router, "127.0.0.1", "gloo", 1.0, 1.0, abort_all_requests=abort_all_requests)
    with broadcaster.engines_paused():
        pass
    assert fake_router.pauses == [{"mode": mode}]
