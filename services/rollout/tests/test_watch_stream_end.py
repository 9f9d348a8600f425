"""How a REST watch stream ends when the run has not: with a comment naming why, and a complete body.

The review's case: only Unavailable was caught inside the stream, so a run whose record was deleted mid-watch
(NotFound) escaped after the response had started: a traceback in the log ("response already started") and a
chunked body cut off. The Runs API is served in process over the Runs core (httpx's ASGI transport: the body is
read once the stream has ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest
from trainer_release_support import runs_core

from rlfleet.api_token import ApiTokenGuard
from rlfleet.v1.runs_pb2 import Run, RunState
from rlfleet_rollout.http_app import build_app
from rlfleet_rollout.runs_core import RunsCore


async def _watch_while(core: RunsCore, meanwhile: Callable[[RunsCore], Coroutine[Any, Any, None]]) -> httpx.Response:
    """The whole answer to a watch of the RUNNING run-a, with `meanwhile` run once the stream has started."""
    guard = ApiTokenGuard(None, core.metrics.registry, "rollout")
    app = build_app(core, core.metrics, core.store.client, guard, watch_keepalive_s=15.0)
    # The app's exceptions reach the client, as a server would log them.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://rollout") as client:
        await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_RUNNING))
        watch = asyncio.ensure_future(client.get("/v1/runs/run-a:watch"))
        await asyncio.sleep(0.3)  # the first event is sent
        await meanwhile(core)
        return await asyncio.wait_for(watch, 10)


def _lines(response: httpx.Response) -> list[str]:
    return [line for line in response.text.splitlines() if line]


def test_a_run_deleted_mid_watch_ends_the_stream_with_a_comment_naming_why(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def delete(core: RunsCore) -> None:
        await core.store.client.delete(core.store.record_key("run-a"))

    async def scenario() -> httpx.Response:
        async with runs_core(redis_prefix) as core:
            return await _watch_while(core, delete)

    response = asyncio.run(scenario())
    assert response.status_code == 200
    lines = _lines(response)
    assert lines[0].startswith("data: ") and '"RUN_STATE_RUNNING"' in lines[0]
    # A comment: SSE clients skip it (`rlfleet watch` reads each `data:` line as a Run), and watch again.
    assert lines[-1] == ": watch ended: run 'run-a' not found"
    assert "Traceback" not in caplog.text and "response already started" not in caplog.text


def test_a_watch_ended_by_a_shutdown_says_so_and_to_watch_again(redis_prefix: str) -> None:
    async def shut_down(core: RunsCore) -> None:
        core.close()

    async def scenario() -> httpx.Response:
        async with runs_core(redis_prefix) as core:
            return await _watch_while(core, shut_down)

    response = asyncio.run(scenario())
    assert response.status_code == 200
    assert _lines(response)[-1] == ": watch ended: orchestrator shutting down; watch again"


def test_the_runs_end_has_an_id_and_a_reconnect_after_it_is_told_nothing_more_comes(redis_prefix: str) -> None:
    """A browser's EventSource reconnects whenever a stream ends: a watch of a run that had ended was sent the run
    again and ended again, every 3 s for as long as the page stayed open."""

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with runs_core(redis_prefix) as core:
            guard = ApiTokenGuard(None, core.metrics.registry, "rollout")
            app = build_app(core, core.metrics, core.store.client, guard, watch_keepalive_s=15.0)
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
            async with httpx.AsyncClient(transport=transport, base_url="http://rollout") as client:
                await core.store.create(Run(id="run-a", state=RunState.RUN_STATE_SUCCEEDED))
                ended = await client.get("/v1/runs/run-a:watch", timeout=10)
                again = await client.get("/v1/runs/run-a:watch", headers={"Last-Event-ID": "end"}, timeout=10)
                await core.store.create(Run(id="run-b", state=RunState.RUN_STATE_RUNNING))
                # A reconnect of a watch whose run has not ended (no id seen, or another) is a watch as any.
                running = asyncio.ensure_future(
                    client.get("/v1/runs/run-b:watch", headers={"Last-Event-ID": "end"}, timeout=10)
                )
                await asyncio.sleep(0.3)
                await core.store.client.delete(core.store.record_key("run-b"))
                return ended, again, await asyncio.wait_for(running, 10)

    ended, again, running = asyncio.run(scenario())
    assert ended.status_code == 200
    assert _lines(ended)[0] == "id: end" and '"RUN_STATE_SUCCEEDED"' in _lines(ended)[1]
    assert again.status_code == 204 and again.content == b""
    assert running.status_code == 200 and not any(line.startswith("id:") for line in _lines(running))
    assert '"RUN_STATE_RUNNING"' in _lines(running)[0]
