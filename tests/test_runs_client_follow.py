"""`RunsClient.follow` across watches the orchestrator ends: each new watch starts by repeating the run, and that
repeat is not a change, so it is not yielded again.

The review's case: an orchestrator that ended its watches (shutting down, restarting) made `follow` yield the same
run once more after every reconnect: `rlfleet watch` printed the same line again, and a caller counting changes
counted one that never happened. The Runs API is scripted here (httpx's mock transport).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from rlfleet.runs_client import RunsClient
from rlfleet.v1.runs_pb2 import RunState


def _run(state: str, step: int) -> dict[str, object]:
    return {"id": "run-a", "state": state, "progress": {"step": step, "total_steps": 3}}


WATCHES = [
    [_run("RUN_STATE_RUNNING", 1)],  # the orchestrator stops: the watch ends with the run going on
    [_run("RUN_STATE_RUNNING", 1)],  # and again, before the run moved
    [_run("RUN_STATE_RUNNING", 1), _run("RUN_STATE_RUNNING", 2), _run("RUN_STATE_SUCCEEDED", 3)],
]
"""What each watch of run-a sends, one after the other: each starts with the run as it is then."""


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[RunsClient]:
    monkeypatch.setattr("rlfleet.runs_client.RECONNECT_BACKOFF_S", (0.01, 0.01))
    watches = iter(WATCHES)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/runs/run-a":
            return httpx.Response(200, json=_run("RUN_STATE_RUNNING", 1))
        assert request.url.path == "/v1/runs/run-a:watch", request.url
        body = "".join(f"data: {json.dumps(run)}\n\n: keep-alive\n\n" for run in next(watches))
        return httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"})

    runs = RunsClient("http://rollout", timeout_s=5)
    runs.http = httpx.Client(base_url=runs.base_url, transport=httpx.MockTransport(answer))
    yield runs
    runs.close()


def test_follow_yields_a_run_again_only_once_it_changed(client: RunsClient) -> None:
    lost: list[str] = []
    runs = list(client.follow("run-a", reconnect_within_s=10, on_lost=lost.append))
    assert [(RunState.Name(run.state), run.progress.step) for run in runs] == [
        ("RUN_STATE_RUNNING", 1),
        ("RUN_STATE_RUNNING", 2),
        ("RUN_STATE_SUCCEEDED", 3),
    ]
    assert len(lost) == 1, lost  # the reconnects happened, and were told of once
