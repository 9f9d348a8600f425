"""Membership through /workers, shaped like sglang-router's API."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

from router_fakes import FakeEngine, RunningRouter


def test_add_list_get_and_remove_workers(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    first, second = start_engine("first"), start_engine("second")
    router = start_router([first.url])
    router.wait_healthy(1)

    added = router.client.post("/workers", json={"url": second.url + "/", "model_id": "ignored", "priority": 5})
    assert added.status_code == 202
    body = added.json()
    assert body["status"] == "accepted" and body["url"] == second.url
    assert body["location"] == f"/workers/{body['worker_id']}" == added.headers["location"]
    router.wait_healthy(2)

    again = router.client.post("/workers", json={"url": second.url})
    assert again.status_code == 200 and again.json()["worker_id"] == body["worker_id"]

    listed = router.client.get("/workers").json()
    assert listed["total"] == 2
    assert {w["url"] for w in listed["workers"]} == {first.url, second.url}
    for worker in listed["workers"]:
        assert set(worker) >= {"id", "url", "healthy", "in_flight", "weight_version"}
        assert worker["weight_version"] == "0"

    one = router.client.get(body["location"]).json()
    assert one["url"] == second.url and one["healthy"] is True

    removed = router.client.delete(f"/workers/{body['worker_id']}")
    assert removed.status_code == 200 and removed.json()["url"] == second.url
    by_url = router.client.delete(f"/workers/{quote(first.url, safe='')}")
    assert by_url.status_code == 200 and by_url.json()["url"] == first.url
    assert router.client.get("/workers").json() == {"workers": [], "total": 0}
    assert router.client.post("/generate", json={"text": "x"}).status_code == 503


def test_bad_worker_requests_are_4xx(start_router: Callable[..., RunningRouter]) -> None:
    router = start_router([])
    bad_url = router.client.post("/workers", json={"url": "localhost:30001"})
    assert bad_url.status_code == 400 and "http://" in bad_url.json()["error"]["message"]
    missing = router.client.post("/workers", json={"address": "http://127.0.0.1:1"})
    assert missing.status_code == 400 and "url" in missing.json()["error"]["message"]
    unknown = router.client.delete("/workers/no-such-worker")
    assert unknown.status_code == 404 and "no-such-worker" in unknown.json()["error"]["message"]
    assert router.client.get("/workers/no-such-worker").status_code == 404


def test_a_worker_is_found_by_the_url_it_was_added_with(start_router: Callable[..., RunningRouter]) -> None:
    """The fleet keeps one spelling of each URL (lower-case scheme and host, no default port); before, GET and
    DELETE compared the key with that spelling as given, and answered 404 for the URL the worker was added with."""
    router = start_router([])
    for given, kept in (
        ("HTTP://Engine-A:30001", "http://engine-a:30001"),
        ("http://127.0.0.1:80/", "http://127.0.0.1"),
    ):
        added = router.client.post("/workers", json={"url": given})
        assert added.status_code == 202 and added.json()["url"] == kept
        assert router.client.get(f"/workers/{quote(given, safe='')}").json()["url"] == kept
        assert router.client.delete(f"/workers/{quote(given, safe='')}").status_code == 200
    assert router.client.get("/workers").json() == {"workers": [], "total": 0}
    assert router.client.get(f"/workers/{quote('http://[::1', safe='')}").status_code == 404
