"""`RunsClient.list` pages through the Runs API until the last page, and stops with an error when an answer names
a page already read as the next one: a proxy answering every page with the first one's answer (a cache ignoring
the query) made `rlfleet runs` loop forever, its memory growing with each repeat. The API is scripted here
(httpx's mock transport)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from rlfleet.errors import Unavailable
from rlfleet.runs_client import RunsClient


def client(answer: Callable[[httpx.Request], httpx.Response]) -> RunsClient:
    runs = RunsClient("http://rollout", timeout_s=5)
    runs.http = httpx.Client(base_url=runs.base_url, transport=httpx.MockTransport(answer))
    return runs


def test_list_reads_every_page_once() -> None:
    pages = {"": (["a", "b"], "p2"), "p2": (["c"], "p3"), "p3": ([], "")}
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        token = request.url.params.get("page_token", "")
        asked.append(token)
        ids, after = pages[token]
        return httpx.Response(200, json={"runs": [{"id": i} for i in ids], "next_page_token": after})

    runs = client(answer)
    try:
        assert [run.id for run in runs.list()] == ["a", "b", "c"]
    finally:
        runs.close()
    assert asked == ["", "p2", "p3"]


def test_list_stops_when_a_page_names_one_already_read_as_the_next() -> None:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params.get("page_token", ""))
        return httpx.Response(200, json={"runs": [{"id": "a"}], "next_page_token": "p2"})  # every page the same

    runs = client(answer)
    try:
        with pytest.raises(Unavailable, match=r"named page 'p2' as the next page again after 2 runs"):
            runs.list()
    finally:
        runs.close()
    assert asked == ["", "p2"]
