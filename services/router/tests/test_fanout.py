"""Control requests fanned out to every engine: what reaches the engines, and what the caller is told."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from router_fakes import FakeEngine, RunningRouter


def test_a_control_body_reaches_every_engine_as_json_whatever_the_client_called_it(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engines = [start_engine("a"), start_engine("b")]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    body = b'{"rid": "r-1"}'
    # curl -d sends form data's type: before, every engine refused it and the abort did nothing.
    for sent in ("application/x-www-form-urlencoded", None):
        headers = {"content-type": sent} if sent else {}
        answer = router.client.post("/abort_request", content=body, headers=headers)
        assert answer.status_code == 200, answer.text
    assert router.client.post("/flush_cache").status_code == 200, "no body, no Content-Type needed"
    for engine in engines:
        assert engine.controls == [
            ("/abort_request", "application/json", body),
            ("/abort_request", "application/json", body),
            ("/flush_cache", None, b""),
        ]


def test_a_control_body_that_is_not_a_json_object_is_refused_before_any_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a")
    router = start_router([engine.url])
    router.wait_healthy(1)
    for body, problem in ((b"rid=r-1", "not valid JSON"), (b'["r-1"]', "must be a JSON object")):
        answer = router.client.post("/pause_generation", content=body)
        assert answer.status_code == 400, answer.text
        assert problem in answer.text
    assert engine.controls == []


def test_an_engine_that_does_not_answer_a_control_request_is_reported_within_its_bound(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Bounded by --control-timeout-secs, not the 600 s bound of a generation: a pause must not hang the trainer."""
    slow, quick = start_engine("slow", control_delay=30.0), start_engine("quick")
    router = start_router([slow.url, quick.url], control_timeout_secs=0.5)
    router.wait_healthy(2)
    started = time.monotonic()
    answer = router.client.post("/pause_generation", json={})
    assert time.monotonic() - started < 5
    assert answer.status_code == 502, answer.text
    by_engine = {e["url"]: e for e in answer.json()["engines"]}
    assert by_engine[quick.url]["status"] == 200
    assert by_engine[slow.url]["status"] is None and "Timeout" in by_engine[slow.url]["message"]


def test_a_control_request_to_an_empty_fleet_is_unavailable(start_router: Callable[..., RunningRouter]) -> None:
    router = start_router([])
    answer = router.client.post("/pause_generation", json={})
    assert answer.status_code == 503
    assert "no engine in the fleet" in answer.text


def test_engines_that_do_not_take_the_fleets_pause_leave_routing(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Refused or unanswered in time: either way the engine may generate between two buckets of a version."""
    refuses = start_engine("refuses", refused_controls={"/pause_generation"})
    slow, takes = start_engine("slow", control_delay=30.0), start_engine("takes")
    router = start_router([refuses.url, slow.url, takes.url], control_timeout_secs=0.5)
    router.wait_healthy(3)
    assert router.client.post("/pause_generation", json={}).status_code == 502
    assert [w["healthy"] for w in router.workers()] == [False, False, True]
    answers = [router.client.post("/generate", json={"text": str(i)}) for i in range(4)]
    assert {a.json()["meta_info"]["engine"] for a in answers} == {"takes"}


def test_a_pause_no_engine_took_takes_no_engine_out_of_routing(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The fleet is not paused then: nothing is to be kept from generating."""
    engines = [start_engine(name, refused_controls={"/pause_generation"}) for name in "ab"]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    assert router.client.post("/pause_generation", json={}).status_code == 502
    assert [w["healthy"] for w in router.workers()] == [True, True]


def test_a_flush_cache_keeps_its_query_and_may_be_a_get_as_at_sglang(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang's /flush_cache takes its timeout in the query and answers GET too (slime's client uses GET): the
    query was dropped on the way to the engines, and a GET was refused with 405."""
    engines = [start_engine("a"), start_engine("b")]
    router = start_router([e.url for e in engines])
    router.wait_healthy(2)
    assert router.client.post("/flush_cache?timeout=30").status_code == 200
    assert router.client.get("/flush_cache").status_code == 200
    for engine in engines:
        assert [c[0] for c in engine.controls] == ["/flush_cache", "/flush_cache"]
        assert engine.control_queries == ["timeout=30", ""]


def test_a_control_some_engines_took_is_not_answered_as_a_bad_request(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """One engine paused, the other refused (404: an SGLang without the route): 400 read as "nothing happened, the
    request was malformed", though an engine was paused; only a refusal by every engine is a 400."""
    takes, refuses = start_engine("takes"), start_engine("refuses", refused_controls={"/pause_generation"})
    refuses.refused_with = 404
    router = start_router([takes.url, refuses.url])
    router.wait_healthy(2)
    answer = router.client.post("/pause_generation", json={})
    assert answer.status_code == 502, answer.text
    assert [e["status"] for e in answer.json()["engines"]] == [200, 404]
    takes.refused_controls.add("/abort_request")
    takes.refused_with = 404
    refuses.refused_controls.add("/abort_request")
    assert router.client.post("/abort_request", json={"rid": "r"}).status_code == 400


def test_a_control_whose_every_engine_was_removed_meanwhile_is_not_answered_as_a_success(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """Every engine removed while it was asked: no engine took the pause, so the caller must not read it as taken.
    Before, the answer was 200 with success true ("0/0 engines answered 2xx")."""
    engine = start_engine("a", control_delay=30.0)
    router = start_router([engine.url], control_timeout_secs=60.0)
    router.wait_healthy(1)
    worker_id = router.workers()[0]["id"]
    remove = threading.Timer(0.5, lambda: router.client.delete(f"/workers/{worker_id}"))
    remove.start()
    try:
        answer = router.client.post("/pause_generation", json={})
    finally:
        remove.join(5)
    assert answer.status_code == 503, answer.text
    assert "removed" in answer.json()["error"]["message"], answer.text
