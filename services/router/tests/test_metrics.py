"""/metrics exports every series the dashboards use, with values that follow what happened."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from router_fakes import FakeEngine, RunningRouter, metric_value


def test_metrics_follow_requests_health_and_weight_updates(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    up, down = start_engine("up"), start_engine("down")
    router = start_router([up.url, down.url], health_failure_threshold=1)
    router.wait_healthy(2)
    for _ in range(3):
        assert router.client.post("/generate", json={"text": "x"}).status_code == 200
    assert router.client.post("/generate", content=b"nope").status_code == 400
    update = {"model_path": "/ckpt/3", "weight_version": "3"}
    assert router.client.post("/update_weights_from_disk", json=update).status_code == 200
    down.healthy = False
    router.wait_healthy(1)

    answer = router.client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    assert metric_value(text, "rlfleet_router_requests_total", {"route": "/generate", "status": "200"}) == 3
    assert metric_value(text, "rlfleet_router_requests_total", {"route": "/generate", "status": "400"}) == 1
    assert metric_value(text, "rlfleet_router_request_seconds_count", {"route": "/generate"}) == 4
    assert metric_value(text, "rlfleet_router_engine_healthy", {"engine": up.url}) == 1
    assert metric_value(text, "rlfleet_router_engine_healthy", {"engine": down.url}) == 0
    assert metric_value(text, "rlfleet_router_engine_in_flight", {"engine": up.url}) == 0
    assert metric_value(text, "rlfleet_router_weight_version") == 3
    assert metric_value(text, "rlfleet_router_weight_updates_total", {"result": "success"}) == 1
    assert metric_value(text, "rlfleet_router_retries_total") == 0

    failures = {"engine": down.url}
    assert (metric_value(text, "rlfleet_router_health_check_failures_total", failures) or 0) >= 1
    router.client.delete(f"/workers/{down.url}")
    after = router.client.get("/metrics").text
    assert metric_value(after, "rlfleet_router_engine_healthy", {"engine": down.url}) is None
    # Its counters go too: engines that come and go (pods by IP) would otherwise add series without end.
    assert metric_value(after, "rlfleet_router_health_check_failures_total", failures) is None
    assert metric_value(after, "rlfleet_router_engine_healthy", {"engine": up.url}) == 1


def test_an_engines_counters_exist_at_zero_from_the_moment_it_joins(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A counter series that appears only at its first increment hides that increment from rate() and
    increase(): a first restart, error or failed weight update would never show on a dashboard."""
    first, second = start_engine("first"), start_engine("second")
    router = start_router([first.url])
    router.wait_healthy(1)
    assert router.client.post("/workers", json={"url": second.url}).status_code in (200, 201, 202)
    text = router.client.get("/metrics").text
    for engine in (first.url, second.url):
        for result in ("success", "failure"):
            assert metric_value(text, "rlfleet_router_engine_restarts_total", {"engine": engine, "result": result}) == 0
        for kind in ("connection", "http_5xx", "engine_failed"):
            assert metric_value(text, "rlfleet_router_engine_errors_total", {"engine": engine, "kind": kind}) == 0
        for name in ("health_check_failures", "engine_version_drifts", "prompt_tokens", "cached_tokens"):
            assert metric_value(text, f"rlfleet_router_{name}_total", {"engine": engine}) == 0, name
    for result in ("success", "partial", "failure"):
        assert metric_value(text, "rlfleet_router_weight_updates_total", {"result": result}) == 0
    # Nor a first routing decision or answer: "Routing decisions by reason" showed none of a fresh router's.
    for reason in ("cache_hit", "imbalance", "low_match", "least_load", "round_robin"):
        assert metric_value(text, "rlfleet_router_routing_decisions_total", {"reason": reason}) == 0, reason
    # A first refusal or failure too: what a generation route answers when it refuses a request (400), fails itself
    # (500), finds no engine to answer (503) or runs out of the request's deadline (504).
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        for status in ("200", "400", "500", "503", "504"):
            labels = {"route": route, "status": status}
            assert metric_value(text, "rlfleet_router_requests_total", labels) == 0, labels


def test_a_request_with_a_budget_beyond_a_double_leaves_metrics_readable(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The router forwards a budget the engine will judge; its own load estimate must stay a number Prometheus
    can export while the request is in flight."""
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    huge = b'{"text": "x", "delay": 1.5, "sampling_params": {"max_new_tokens": 1' + b"0" * 400 + b"}}"
    with ThreadPoolExecutor(max_workers=1) as pool:
        json_type = {"content-type": "application/json"}
        pending = pool.submit(router.client.post, "/generate", content=huge, headers=json_type)
        router.wait_for(lambda: engine.in_flight == 1, what="the request at the engine")
        answer = router.client.get("/metrics")
        assert answer.status_code == 200, answer.text
        tokens = metric_value(answer.text, "rlfleet_router_engine_in_flight_tokens", {"engine": engine.url})
        assert tokens is not None and 0 < tokens <= 2**53
        assert pending.result(timeout=10).status_code == 200
    assert engine.raw_bodies == [huge]
    assert router.workers()[0]["in_flight_tokens"] == 0


def test_questions_about_the_engines_are_no_routing_decisions(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """A client that polls /v1/models (the OpenAI SDK's models.list, a gateway's check) counted one `no_prompt`
    routing decision per call, and each weighed in the policy's recent traffic as a request sent there."""
    router = start_router([start_engine("a").url, start_engine("b").url])
    router.wait_healthy(2)
    for route in ("/v1/models", "/get_model_info", "/get_server_info") * 3:
        assert router.client.get(route).status_code in (200, 404), route
    text = router.client.get("/metrics").text
    for reason in ("cache_hit", "imbalance", "low_match", "least_load", "no_prompt"):
        assert not metric_value(text, "rlfleet_router_routing_decisions_total", {"reason": reason}), reason
