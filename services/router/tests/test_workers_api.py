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


def test_sglang_routers_older_api_adds_lists_and_removes_workers(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """sglang-router's query-string API, as slime's launcher registers each engine (POST /add_worker?url=, the URL
    not percent-encoded) and tools list and drop them; before, each of these paths answered 404."""
    first, second = start_engine("first"), start_engine("second")
    router = start_router([])
    assert router.client.get("/list_workers").json() == {"urls": []}

    added = router.client.post(f"/add_worker?url={first.url}")
    assert added.status_code == 200, added.text
    body = added.json()
    assert body["status"] == "accepted" and body["url"] == first.url
    assert body["location"] == f"/workers/{body['worker_id']}" == added.headers["location"]
    router.wait_healthy(1)
    assert router.client.post("/generate", json={"text": "x"}).status_code == 200

    # The URL in a JSON body (slime's own router takes it there too), in one spelling per engine.
    in_body = router.client.post("/add_worker", json={"url": second.url + "/"})
    assert in_body.status_code == 200 and in_body.json()["url"] == second.url
    router.wait_healthy(2)
    assert router.client.get("/list_workers").json() == {"urls": [first.url, second.url]}

    # Registering again (an engine that restarted) changes nothing.
    again = router.client.post("/add_worker", params={"url": first.url})
    assert again.status_code == 200 and again.json()["status"] == "exists"
    assert again.json()["worker_id"] == body["worker_id"]
    assert router.client.get("/workers").json()["total"] == 2

    removed = router.client.post(f"/remove_worker?url={first.url}")
    assert removed.status_code == 200 and removed.json() == {
        "status": "removed",
        "worker_id": body["worker_id"],
        "url": first.url,
    }
    assert router.client.post("/remove_worker", json={"url": second.url}).status_code == 200
    assert router.client.get("/list_workers").json() == {"urls": []}
    gone = router.client.post("/remove_worker", params={"url": first.url})
    assert gone.status_code == 404 and first.url in gone.json()["error"]["message"]


def test_bad_older_api_requests_are_400_naming_the_field(start_router: Callable[..., RunningRouter]) -> None:
    router = start_router([])
    for path in ("/add_worker", "/remove_worker"):
        missing = router.client.post(path)
        assert missing.status_code == 400 and "url: required" in missing.json()["error"]["message"]
        not_text = router.client.post(path, json={"url": 30001})
        assert not_text.status_code == 400 and "url: must be a string" in not_text.json()["error"]["message"]
        twice = router.client.post(path, params={"url": "http://a:1"}, json={"url": "http://b:1"})
        assert twice.status_code == 400 and "url: given twice" in twice.json()["error"]["message"]
        not_json = router.client.post(path, content=b"url=http://a:1")
        assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    bad_url = router.client.post("/add_worker", params={"url": "localhost:30001"})
    assert bad_url.status_code == 400 and "http://" in bad_url.json()["error"]["message"]
    prefill = router.client.post("/add_worker", params={"url": "http://a:1", "worker_type": "prefill"})
    assert prefill.status_code == 400 and "prefill workers are not supported" in prefill.json()["error"]["message"]
    assert router.client.get("/list_workers").json() == {"urls": []}


def test_post_workers_takes_sglang_routers_fields_or_refuses_them_by_name(
    start_router: Callable[..., RunningRouter],
) -> None:
    """sglang-router's WorkerConfigRequest: slime registers {"url", "worker_type": "regular"}; before, every other
    field was dropped unread, so a prefill or decode engine joined as a regular one (202) and took whole requests."""
    router = start_router([])
    regular = {
        "url": "http://engine-a:30001",
        "worker_type": "regular",
        "model_id": "qwen",
        "priority": 50,
        "cost": 1.0,
        "labels": {"zone": "a"},
        "tokenizer_path": "/models/qwen",
        "api_key": None,
        "bootstrap_port": None,
        "a_field_of_a_newer_sglang_router": True,
    }
    assert router.client.post("/workers", json=regular).status_code == 202

    for worker_type in ("prefill", "decode"):
        refused = router.client.post("/workers", json={"url": "http://engine-b:30001", "worker_type": worker_type})
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400, refused.text
        assert "worker_type" in message and f"{worker_type} workers are not supported" in message
    for field, value, words in (
        ("worker_type", "encoder", "must be 'regular'"),
        ("api_key", "sk-engine", "no API key"),
        ("bootstrap_port", 8998, "only prefill workers"),
        ("priority", "high", "priority"),
        ("cost", -1, "cost"),
        ("labels", ["zone"], "labels"),
    ):
        refused = router.client.post("/workers", json={"url": "http://engine-b:30001", field: value})
        assert refused.status_code == 400, (field, refused.text)
        message = refused.json()["error"]["message"]
        assert field in message and words in message, message
    assert [w["url"] for w in router.workers()] == ["http://engine-a:30001"]
