"""The health loop: engines leave routing after failing probes and return after passing ones."""

from __future__ import annotations

from collections.abc import Callable

from router_fakes import FakeEngine, RunningRouter

from rlfleet.processes import free_port


def test_failing_engine_leaves_routing_after_threshold_and_returns_after_recovery(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    flaky, steady = start_engine("flaky"), start_engine("steady")
    router = start_router([flaky.url, steady.url], health_failure_threshold=3, health_success_threshold=2)
    router.wait_healthy(2)

    flaky.healthy = False
    router.wait_for(lambda: len([w for w in router.workers() if w["healthy"]]) == 1, what="flaky taken out")
    out = next(w for w in router.workers() if w["url"] == flaky.url)
    assert out["state"] == "unhealthy" and "HTTP 503" in str(out["last_error"])
    before = len(flaky.raw_bodies)
    for _ in range(4):
        assert router.client.post("/generate", json={"text": "x"}).json()["meta_info"]["engine"] == "steady"
    assert len(flaky.raw_bodies) == before

    flaky.healthy = True
    router.wait_healthy(2)
    answers = {router.client.post("/generate", json={"text": "x"}).json()["meta_info"]["engine"] for _ in range(4)}
    assert answers == {"flaky", "steady"}


def test_router_health_follows_the_fleet(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("only")
    router = start_router([engine.url], health_failure_threshold=1, health_success_threshold=1)
    router.wait_healthy(1)
    assert router.client.get("/health").json() == {"status": "ok", "healthy": 1, "total": 1}
    assert router.client.head("/health").status_code == 200, "a load balancer's HEAD probe, as SGLang answers it"

    engine.healthy = False
    router.wait_for(lambda: router.client.get("/health").status_code == 503, what="router unhealthy")
    reason = router.client.get("/health").json()["error"]["message"]
    assert "no healthy engine: 0 of 1" in reason
    assert router.client.get("/liveness").status_code == 200
    assert router.client.head("/health").status_code == 503

    engine.healthy = True
    router.wait_for(lambda: router.client.get("/readiness").status_code == 200, what="router healthy again")


def test_engine_that_never_answers_stays_pending(start_router: Callable[..., RunningRouter]) -> None:
    router = start_router([f"http://127.0.0.1:{free_port()}"])
    router.wait_for(lambda: router.workers()[0]["last_error"] is not None, what="a failed probe")
    worker = router.workers()[0]
    assert worker["state"] == "pending" and "ConnectError" in str(worker["last_error"])


def test_an_engine_whose_probe_answer_never_ends_leaves_routing(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """httpx bounds each read, not the whole answer: a probe answered a byte at a time, each within the probe's
    timeout, was waited for without end, and its engine (one probe at a time) was never judged again."""
    engine = start_engine("trickling")
    router = start_router([engine.url], health_check_timeout_secs=0.5, health_failure_threshold=2)
    router.wait_healthy(1)

    engine.health_trickle = 0.1
    router.wait_for(lambda: not router.workers()[0]["healthy"], what="the engine taken out")
    assert "ReadTimeout" in str(router.workers()[0]["last_error"])
