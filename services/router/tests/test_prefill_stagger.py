"""The prefill stagger: a repeat of a prompt sent to an engine that is still prefilling its first copy waits
until the first's prefill has begun, so it finds the prompt cached rather than computing it in the same batch."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from router_fakes import FakeEngine, RunningRouter, metric_value

from rlfleet_router.prefill_stagger import PrefillStagger
from rlfleet_router.radix_tree import token_key

STAGGER = 0.010


@dataclass
class Dispatch:
    ended: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def stagger(clock: Clock) -> PrefillStagger:
    return PrefillStagger(STAGGER, clock=clock)


def test_a_repeat_to_the_same_engine_waits_until_the_first_dispatch_plus_the_stagger(
    stagger: PrefillStagger, clock: Clock
) -> None:
    key = token_key([5] * 300)
    assert stagger.delay("e1", key, Dispatch()) == 0.0, "the first dispatch is sent at once"
    clock.now += 0.003
    assert stagger.delay("e1", token_key([5] * 300), Dispatch()) == pytest.approx(0.007)
    clock.now += 0.004
    assert stagger.delay("e1", key, Dispatch()) == pytest.approx(0.003), "every repeat waits for the same moment"
    clock.now += 0.003
    assert stagger.delay("e1", key, Dispatch()) == 0.0, "S after the first: its prefill has begun"


def test_another_engine_another_prompt_or_a_first_dispatch_that_ended_do_not_wait(
    stagger: PrefillStagger, clock: Clock
) -> None:
    first = Dispatch()
    assert stagger.delay("e1", "a prompt", first) == 0.0
    clock.now += 0.001
    assert stagger.delay("e2", "a prompt", Dispatch()) == 0.0, "another engine computes it anyway"
    assert stagger.delay("e1", "another prompt", Dispatch()) == 0.0
    assert stagger.delay("e1", token_key([1, 2, 3]), Dispatch()) == 0.0
    assert stagger.delay("e1", None, Dispatch()) == 0.0, "a request without a prompt key"
    first.ended = True  # answered (its prompt is cached there now) or given up
    assert stagger.delay("e1", "a prompt", Dispatch()) == 0.0


def test_a_new_prompt_sharing_most_of_one_in_flight_waits_for_it_and_its_repeats_wait_for_it_in_turn(
    stagger: PrefillStagger, clock: Clock
) -> None:
    """Two questions of one prompt family (or two conversations opening on one system prompt) sent to an engine
    together would each compute their shared context: the second waits until the first's prefill has begun."""
    context = [7] * 300
    first = Dispatch()
    assert stagger.delay("e1", token_key(context + [1, 2]), first) == 0.0
    clock.now += 0.003
    second = Dispatch()
    assert stagger.delay("e1", token_key(context + [3, 4]), second) == pytest.approx(0.007)
    clock.now += 0.001
    # The second question's own samples wait for it: it is sent at 0.010, so they wait until 0.020.
    assert stagger.delay("e1", token_key(context + [3, 4]), Dispatch()) == pytest.approx(0.016)
    assert stagger.delay("e2", token_key(context + [5]), Dispatch()) == 0.0, "another engine computes it anyway"
    assert stagger.delay("e1", token_key([7] * 100 + [9] * 300), Dispatch()) == 0.0, "less than half in common"
    assert stagger.delay("e1", "".join(map(chr, context)) + "x", Dispatch()) == 0.0, "text is not token ids"
    first.ended = second.ended = True  # the family's context is cached there now
    assert stagger.delay("e1", token_key(context + [6]), Dispatch()) == 0.0


def test_a_repeat_after_the_stagger_is_a_first_dispatch_again(stagger: PrefillStagger, clock: Clock) -> None:
    assert stagger.delay("e1", "p", Dispatch()) == 0.0
    clock.now += 0.025
    assert stagger.delay("e1", "p", Dispatch()) == 0.0
    clock.now += 0.004
    assert stagger.delay("e1", "p", Dispatch()) == pytest.approx(0.006), "waits for the newer first dispatch"


def test_state_is_pruned_past_the_stagger_and_forgotten_with_its_engine(stagger: PrefillStagger, clock: Clock) -> None:
    for n in range(50):
        stagger.delay("e1", f"{n} prompt", Dispatch())  # nothing in common: none waits
        stagger.delay("e2", f"{n} prompt", Dispatch())
    assert len(stagger) == 100
    stagger.forget("e2")
    assert len(stagger) == 50
    assert stagger.delay("e2", "1 prompt", Dispatch()) == 0.0, "a removed engine's first dispatches are gone"
    clock.now += 0.011
    stagger.delay("e1", "fresh", Dispatch())
    assert len(stagger) == 1, "entries older than the stagger are dropped"


def test_zero_turns_it_off(clock: Clock) -> None:
    off = PrefillStagger(0.0, clock=clock)
    assert off.delay("e1", "p", Dispatch()) == 0.0
    assert off.delay("e1", "p", Dispatch()) == 0.0
    assert len(off) == 0


def test_a_negative_stagger_is_refused() -> None:
    with pytest.raises(ValueError, match="stagger"):
        PrefillStagger(-0.001)


def _post(router: RunningRouter, body: dict[str, object], timeout: float = 10.0) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    answer = router.client.post("/generate", json=body, timeout=timeout)
    return time.monotonic() - started, answer


def test_through_the_router_only_a_repeat_of_a_prompt_in_flight_waits_and_not_for_its_answer(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], policy="cache_aware", prefill_stagger_ms=400)
    router.wait_healthy(1)
    prompt = "solve: " + "x" * 200
    first: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: first.append(_post(router, {"text": prompt, "delay": 1.5})[1]))
    sender.start()
    time.sleep(0.1)
    took, answer = _post(router, {"text": prompt})
    assert answer.status_code == 200, answer.text
    assert 0.2 < took < 1.2, f"waited until the first dispatch + 400 ms, not for the first's answer: {took:.3f}s"
    took, answer = _post(router, {"text": "another prompt " + "y" * 200})
    assert answer.status_code == 200 and took < 0.25, f"another prompt is not delayed: {took:.3f}s"
    sender.join(10)
    assert first and first[0].status_code == 200
    took, answer = _post(router, {"text": prompt})
    assert answer.status_code == 200 and took < 0.25, f"the first one answered: nothing to wait for: {took:.3f}s"
    text = router.client.get("/metrics").text
    assert metric_value(text, "rlfleet_router_prefill_staggers_total") == 1
    assert len(engine.raw_bodies) == 4


def test_a_request_whose_client_leaves_while_it_waits_is_not_sent(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url], policy="cache_aware", prefill_stagger_ms=800)
    router.wait_healthy(1)
    prompt = "solve: " + "z" * 200
    sender = threading.Thread(target=lambda: _post(router, {"text": prompt, "delay": 1.5, "rid": "first/"}))
    sender.start()
    time.sleep(0.1)
    with pytest.raises(httpx.ReadTimeout):
        _post(router, {"text": prompt, "rid": "gone/"}, timeout=0.2)
    time.sleep(1.0)  # past the moment it would have been sent
    sender.join(10)
    rids = [json.loads(raw).get("rid") for raw in engine.raw_bodies]
    assert rids == ["first/"], "the request given up while it waited never reached the engine"
    assert not [c for c in engine.controls if c[0] == "/abort_request"], "nothing to abort where it was not sent"
    text = router.client.get("/metrics").text
    assert metric_value(text, "rlfleet_router_requests_total", {"route": "/generate", "status": "499"}) == 1
    assert metric_value(text, "rlfleet_router_engine_in_flight", {"engine": engine.url}) == 0


def test_a_request_whose_deadline_passes_while_it_waits_is_504_and_never_charges_its_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router(
        [engine.url],
        policy="cache_aware",
        prefill_stagger_ms=800,
        request_timeout_secs=0.4,
        health_check_interval_secs=60,
        health_failure_threshold=1,
    )
    router.wait_healthy(1)
    prompt = "solve: " + "d" * 200
    first: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: first.append(_post(router, {"text": prompt, "delay": 1.0})[1]))
    sender.start()
    router.wait_for(lambda: engine.in_flight == 1, what="the first request at the engine")
    took, answer = _post(router, {"text": prompt, "rid": "late/"})
    sender.join(10)
    assert answer.status_code == 504, answer.text
    assert took < 0.75, f"given up at its deadline, not at the end of its 800 ms wait: {took:.3f}s"
    assert [json.loads(raw).get("rid") for raw in engine.raw_bodies] == [None], "sent after its deadline"
    [worker] = router.workers()
    assert worker["healthy"] is True and worker["last_error"] is None, worker
    text = router.client.get("/metrics").text
    assert metric_value(text, "rlfleet_router_engine_errors_total", {"engine": engine.url, "kind": "connection"}) == 0
    assert metric_value(text, "rlfleet_router_engine_in_flight", {"engine": engine.url}) == 0


def test_a_request_held_back_at_an_engine_removed_meanwhile_goes_to_another(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A removed engine keeps its healthy state: the held-back repeat was sent to it all the same."""
    engines = [start_engine("a"), start_engine("b")]
    router = start_router([e.url for e in engines], policy="cache_aware", prefill_stagger_ms=1000)
    router.wait_healthy(2)
    body = {"input_ids": list(range(200)), "delay": 3}
    answers: dict[str, httpx.Response] = {}
    first = threading.Thread(target=lambda: answers.setdefault("first", router.client.post("/generate", json=body)))
    first.start()
    router.wait_for(
        lambda: [w["in_flight"] for w in router.workers()].count(1) == 1, what="the first request in flight"
    )
    holder = next(w for w in router.workers() if w["in_flight"] == 1)
    repeat = {**body, "delay": 0}
    second = threading.Thread(target=lambda: answers.setdefault("repeat", router.client.post("/generate", json=repeat)))
    second.start()
    router.wait_for(lambda: any(w["in_flight"] == 2 for w in router.workers()), what="the repeat held back")
    assert router.client.delete(f"/workers/{holder['id']}").status_code == 200
    second.join(20)
    first.join(20)
    assert answers["repeat"].status_code == 200, answers["repeat"].text
    assert answers["repeat"].headers["x-rlfleet-engine"] != holder["url"]
