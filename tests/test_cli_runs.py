"""`rlfleet runs` and `rlfleet watch` against a scripted Runs API: every page is read and the newest runs are
shown first, a stalled run is shown as such, a watch outlives a quiet run through keep-alives but not a
silent server (and off a terminal prints a progress line only when it changes), a watch the orchestrator ends
while the run goes on (it restarts) reconnects, and says so with exit code 3 when it gives up, a server that
never answers fails within --timeout saying the watch never started, the fleet `rlfleet up` recorded is found
without --api, and with none recorded an unanswered default address says where it was looked for. `submit
--dry-run` prints the spec the orchestrator resolved and submits nothing. The client's `cancel_after` cancels a
run still quiet past its time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from rlfleet.cli.main import main
from rlfleet.cli.runs import progress_line
from rlfleet.errors import Unavailable
from rlfleet.local_fleet import record_starting, remove_own_record
from rlfleet.processes import free_port
from rlfleet.runs_client import RunsClient, load_spec_file
from rlfleet.v1.runs_pb2 import EvalResult, Run, RunProgress, RunState

STALL = "no progress for 15 s at step 2 of 6: waiting for the trainer (at weight version 2)"
PAGE_CAP = 50
"""The fake serves at most this many runs per page, whatever the client asks: paging must be followed."""


def run_json(i: int, state: str = "RUN_STATE_SUCCEEDED", stalled: str = "", step: int = 6) -> dict[str, Any]:
    return {
        "id": f"run-{i:04d}",
        "spec": {"name": f"n{i}"},
        "state": state,
        "progress": {"step": step, "total_steps": 6, "mean_reward": 0.5},
        "stalled": stalled,
    }


RUNS = (
    [run_json(i) for i in range(117)]
    + [run_json(117, "RUN_STATE_RUNNING", step=3), run_json(118)]
    + [run_json(119, "RUN_STATE_RUNNING", STALL, step=2)]
)
STATES = {"QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"}
WATCH_SCRIPT: list[tuple[float, str]] = [
    (0.0, "data: " + json.dumps(run_json(7, "RUN_STATE_RUNNING", step=2))),
    *[(0.1, ": keep-alive")] * 5,
    (0.0, "data: " + json.dumps(run_json(7, "RUN_STATE_RUNNING", STALL, step=2))),
    (0.1, ": keep-alive"),
    (0.0, "data: " + json.dumps(run_json(7, "RUN_STATE_RUNNING", step=3))),
    (0.0, "data: " + json.dumps(run_json(7, "RUN_STATE_SUCCEEDED", step=6))),
]
REPEATS_SCRIPT: list[tuple[float, str]] = [
    (0.0, "data: " + json.dumps(run_json(8, "RUN_STATE_RUNNING", step=step))) for step in (1, 1, 1, 2, 2, 2, 2)
] + [(0.0, "data: " + json.dumps(run_json(8, "RUN_STATE_SUCCEEDED", step=6)))]
"""A step brings several events (groups produced, trained) that look the same on a progress line."""


RESTART_SCRIPTS: list[list[tuple[float, str]] | int] = [
    [(0.0, "data: " + json.dumps(run_json(9, "RUN_STATE_RUNNING", step=2)))],  # the orchestrator stops
    503,  # it is starting again
    [
        (0.0, "data: " + json.dumps(run_json(9, "RUN_STATE_RUNNING", step=3))),
        (0.0, "data: " + json.dumps(run_json(9, "RUN_STATE_SUCCEEDED", step=6))),
    ],
]
"""What each watch of run-0009 gets, one connection after the other: the orchestrator restarts under it."""
ENDING = {10, 500}
"""Every watch of these runs (run-0500 is the one `submit` makes) ends at once while the run goes on."""
QUIET_RESTARTS = 3
"""run-0013 is quiet (keep-alives only) through this many restarts of the orchestrator, each 1.2 s apart."""
RUNNING_IDS = {9, 13} | ENDING
WATCHES: dict[str, int] = {}
"""How many watches of each run the fake has answered."""


CANCELS: list[str] = []
"""The runs the fake was asked to cancel; a watch of run-0012 keeps it running (keep-alives only) until then."""


SUBMITTED: list[dict[str, Any]] = []
"""The specs the fake was sent, as JSON."""
VALIDATED: list[dict[str, Any]] = []
"""The specs the fake was asked to validate only, as JSON."""
NO_STEPS = {"kind": "invalid_input", "message": "schedule.steps: is required: set the run's training steps (>= 1)"}


def build_api() -> FastAPI:
    app = FastAPI()

    @app.get("/guarded/v1/runs")  # an orchestrator with an API token, asked without it
    async def guarded() -> JSONResponse:
        refusal = {
            "kind": "unauthenticated",
            "message": "missing API token: send the header 'Authorization: Bearer <token>'",
        }
        return JSONResponse({"error": refusal}, status_code=401)

    @app.get("/site/{page:path}")  # a web server of another kind: a page for every path
    async def page(page: str) -> HTMLResponse:
        return HTMLResponse(f"<html><body>{page}</body></html>")

    @app.get("/v1/runs")
    async def list_runs(page_size: int = 0, page_token: str = "", state: str = "") -> JSONResponse:
        if state and state.upper() not in STATES:  # as the orchestrator: `stalled` is no state of its own
            return JSONResponse({"error": {"message": f"state: unknown run state {state!r}"}}, status_code=400)
        runs = [run for run in RUNS if not state or run["state"] == f"RUN_STATE_{state.upper()}"]
        start = int(page_token or 0)
        end = min(start + min(page_size or PAGE_CAP, PAGE_CAP), len(runs))
        return JSONResponse({"runs": runs[start:end], "next_page_token": str(end) if end < len(runs) else ""})

    @app.post("/v1/runs")
    async def submit(request: Request, validate_only: bool = False) -> JSONResponse:
        spec = await request.json()
        if not spec.get("schedule", {}).get("steps"):
            return JSONResponse({"error": {**NO_STEPS, "code": 400}}, status_code=400)
        if validate_only:  # as the orchestrator answers: the run it would create, resolved, without an id
            VALIDATED.append(spec)
            resolved = {**spec, "rollout": {"function": "single_turn", **spec.get("rollout", {})}}
            return JSONResponse({"spec": resolved, "state": "RUN_STATE_QUEUED", "progress": {"total_steps": "6"}})
        SUBMITTED.append(spec)
        return JSONResponse({**run_json(500, "RUN_STATE_QUEUED", step=0), "spec": SUBMITTED[-1]})

    @app.get("/v1/runs/{run_id}:watch", response_model=None)
    async def watch(run_id: str) -> StreamingResponse | JSONResponse:
        WATCHES[run_id] = WATCHES.get(run_id, 0) + 1
        scripts = {"run-0007": WATCH_SCRIPT, "run-0008": REPEATS_SCRIPT}
        for i in ENDING:
            scripts[f"run-{i:04d}"] = [(0.0, "data: " + json.dumps(run_json(i, "RUN_STATE_RUNNING", step=2)))]
        if run_id == "run-0009":
            scripts[run_id] = RESTART_SCRIPTS[min(WATCHES[run_id], len(RESTART_SCRIPTS)) - 1]  # type: ignore[assignment]
        if run_id == "run-0013":
            up = [(0.0, "data: " + json.dumps(run_json(13, "RUN_STATE_RUNNING", step=2))), *[(0.2, ": keep-alive")] * 6]
            done = [(0.0, "data: " + json.dumps(run_json(13, "RUN_STATE_SUCCEEDED", step=6)))]
            scripts[run_id] = up if WATCHES[run_id] <= QUIET_RESTARTS else up[:1] + done
        quiet = [(0.0, "data: " + json.dumps(run_json(int(run_id[4:]), "RUN_STATE_RUNNING", step=2)))]
        script = scripts.get(run_id, [*quiet, (30.0, ": keep-alive")])
        if isinstance(script, int):
            return JSONResponse({"error": {"message": "starting"}}, status_code=script)
        if run_id == "run-0012":
            return StreamingResponse(quiet_until_cancelled(), media_type="text/event-stream")

        async def lines() -> AsyncIterator[str]:
            for delay, line in script:
                await asyncio.sleep(delay)
                yield line + "\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    async def quiet_until_cancelled() -> AsyncIterator[str]:
        yield "data: " + json.dumps(run_json(12, "RUN_STATE_RUNNING", step=2)) + "\n\n"
        for _ in range(100):  # 10 s at most
            if "run-0012" in CANCELS:
                yield "data: " + json.dumps(run_json(12, "RUN_STATE_CANCELLED", step=2)) + "\n\n"
                return
            await asyncio.sleep(0.1)
            yield ": keep-alive\n\n"

    def not_held(run_id: str) -> JSONResponse:
        """As the orchestrator answers for a run it does not hold."""
        error = {"kind": "not_found", "message": f"run {run_id!r} not found", "code": 404}
        return JSONResponse({"error": error}, status_code=404)

    @app.post("/v1/runs/{run_id}:cancel")
    async def cancel(run_id: str) -> JSONResponse:
        if not run_id.removeprefix("run-").isdigit():
            return not_held(run_id)
        CANCELS.append(run_id)
        return JSONResponse(run_json(int(run_id.removeprefix("run-")), "RUN_STATE_CANCELLED", step=2))

    @app.get("/v1/runs/{run_id}")
    async def get(run_id: str) -> JSONResponse:
        if not run_id.removeprefix("run-").isdigit():
            return not_held(run_id)
        i = int(run_id.removeprefix("run-"))
        return JSONResponse(run_json(i, "RUN_STATE_RUNNING", step=2) if i in RUNNING_IDS else run_json(i, step=6))

    return app


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_api(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake Runs API did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(autouse=True)
def no_api_url_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLFLEET_API_URL", raising=False)


def listed_ids(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:] if line.startswith("run-") and " stalled: " not in line]


def test_runs_shows_the_newest_first_and_says_how_many_it_left_out(api: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["runs", "--api", api]) == 0
    out = capsys.readouterr().out
    assert listed_ids(out) == [f"run-{i:04d}" for i in range(119, 99, -1)]
    assert "(the newest 20 of 120 runs; --limit N or --all shows more)" in out


def test_runs_limit_and_all(api: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["runs", "--api", api, "--limit", "3"]) == 0
    assert listed_ids(capsys.readouterr().out) == ["run-0119", "run-0118", "run-0117"]
    assert main(["runs", "--api", api, "--all"]) == 0
    out = capsys.readouterr().out
    assert listed_ids(out) == [f"run-{i:04d}" for i in range(119, -1, -1)]
    assert "newest" not in out


def test_runs_state_filters_and_stalled_is_a_running_run_without_progress(
    api: str, capsys: pytest.CaptureFixture
) -> None:
    """The STATE column says `stalled`, so --state takes it, though the API knows no such state."""
    assert main(["runs", "--api", api, "--state", "stalled"]) == 0
    assert listed_ids(capsys.readouterr().out) == ["run-0119"]
    assert main(["runs", "--api", api, "--state", "RUNNING"]) == 0
    assert listed_ids(capsys.readouterr().out) == ["run-0119", "run-0117"]


def test_runs_refuses_an_unknown_state_naming_those_it_takes(capsys: pytest.CaptureFixture) -> None:
    """It was sent to the orchestrator, whose refusal listed the API's names (RUN_STATE_QUEUED, ...), none of
    which `runs` shows, and needed an orchestrator to answer."""
    with pytest.raises(SystemExit) as usage:
        main(["runs", "--api", f"http://127.0.0.1:{free_port()}", "--state", "bogus"])
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "argument --state: invalid choice: 'bogus'" in err
    assert "'queued', 'running', 'stalled', 'succeeded', 'failed', 'cancelled'" in err, err


@pytest.mark.parametrize("value", ["inf", "1e400", "-inf", "nan", "0"])
def test_a_timeout_must_be_a_finite_number_above_0(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["runs", "--api", f"http://127.0.0.1:{free_port()}", f"--timeout={value}"])
    assert usage.value.code == 2
    assert f"argument --timeout: must be a finite number > 0, got {value}" in capsys.readouterr().err


def test_an_api_url_without_a_scheme_is_taken_as_http(api: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["runs", "--api", api.removeprefix("http://"), "--limit", "1"]) == 0
    assert listed_ids(capsys.readouterr().out) == ["run-0119"]


@pytest.mark.parametrize("command", [["runs"], ["watch", "run-0007"], ["cancel", "run-0007"]])
def test_an_api_url_that_does_not_serve_the_runs_api_is_named_as_such(
    api: str, tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture
) -> None:
    """A router's or reward hub's URL answers 404 for every Runs API path (here: a path below the fake's)."""
    elsewhere = f"{api}/router"
    assert main([*command, "--api", elsewhere, "--state-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"rlfleet: error: {elsewhere} does not serve the Runs API ("), error
    assert f"--api wants the orchestrator's REST URL (api_url in {tmp_path / 'fleet.json'})" in error


def test_a_refusal_for_want_of_a_token_says_where_the_cli_reads_it(
    api: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The server names its header; a CLI user sets a file or a variable, which the refusal never named."""
    assert main(["runs", "--api", f"{api}/guarded", "--state-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "missing API token" in error
    assert "read from --api-token-file, $RLFLEET_API_TOKEN_FILE, or $RLFLEET_API_TOKEN" in error, error


def test_a_server_answering_other_than_json_is_named_as_no_runs_api(
    api: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before, only the JSON decoder spoke: `rlfleet: error: Expecting value: line 1 column 1 (char 0)`."""
    elsewhere = f"{api}/site"
    assert main(["runs", "--api", elsewhere, "--state-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        f"rlfleet: error: {elsewhere} does not serve the Runs API (GET /site/v1/runs answered 200 with something "
        "other than JSON); --api wants the orchestrator's REST URL"
    ), error


def test_a_grpc_port_given_for_the_runs_api_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The orchestrator's gRPC port (50051) beside its REST one: the error was `did not answer: illegal request
    line`, as though nothing listened there."""
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main(["runs", "--api", f"127.0.0.1:{port}", "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
    finally:
        server.stop(0)
    error = capsys.readouterr().err
    assert error.startswith(
        f"rlfleet: error: http://127.0.0.1:{port} does not serve the Runs API: it answered in something other than "
        "HTTP/1.1 ("
    ), error
    assert "as a gRPC port does" in error and "--api wants the orchestrator's REST URL" in error, error


def test_a_server_that_closes_the_connection_is_unavailable_not_another_protocol(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def close_each() -> None:
            with contextlib.suppress(OSError):
                connection, _ = listener.accept()
                connection.recv(4096)
                connection.close()

        closer = threading.Thread(target=close_each, daemon=True)
        closer.start()
        assert main(["runs", "--api", f"127.0.0.1:{port}", "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
        closer.join(5)
    error = capsys.readouterr().err
    assert error.startswith(f"rlfleet: error: the orchestrator at http://127.0.0.1:{port} did not answer: "), error


@pytest.mark.parametrize("source", ["--api", "$RLFLEET_API_URL", "fleet.json"])
def test_a_malformed_address_is_one_line_naming_where_it_came_from(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Before, a traceback (httpx.InvalidURL) and exit 1, which `watch` gives a failed run."""
    bad = "http://127.0.0.1:80a0"
    argv = ["cancel", "run-0007", "--state-dir", str(tmp_path)]
    if source == "--api":
        argv += ["--api", bad]
    elif source == "$RLFLEET_API_URL":
        monkeypatch.setenv("RLFLEET_API_URL", bad)
    else:
        (tmp_path / "fleet.json").write_text(json.dumps({"pid": 1, "state": "up", "api_url": bad, "processes": {}}))
        source = f"api_url in {tmp_path / 'fleet.json'}"
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"rlfleet: error: {bad!r} is not an address of the Runs API ("), error
    assert error.rstrip().endswith(f"the address came from {source}") and "Traceback" not in error, error


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("ftp://127.0.0.1:8000", "the scheme is 'ftp', not http or https"),
        ("http://127.0.0.1:99999", "port 99999 is outside 1-65535"),
        ("127.0.0.1:0", "port 0 is outside 1-65535"),
    ],
)
def test_an_address_no_runs_api_can_have_is_refused_as_such(bad: str, why: str, capsys: pytest.CaptureFixture) -> None:
    """Before, each was tried, and "did not answer: [Errno 111] Connection refused" sent one looking for a server."""
    assert main(["runs", "--api", bad, "--timeout", "2"]) == 2
    assert capsys.readouterr().err == (
        f"rlfleet: error: {bad!r} is not an address of the Runs API ({why}); the address came from --api\n"
    )


@pytest.mark.parametrize("command", ["watch", "cancel"])
def test_a_run_the_orchestrator_does_not_hold_is_not_found_there(
    api: str, command: str, capsys: pytest.CaptureFixture
) -> None:
    """Named with the address asked and where it came from (a stale fleet.json or $RLFLEET_API_URL names another
    fleet): it said only "HTTP 404: run 'run-none' not found"."""
    assert main([command, "run-none", "--api", api]) == 2
    assert capsys.readouterr().err == (
        f"rlfleet: error: no run 'run-none' at {api} (the address came from --api); `rlfleet runs --api {api}` "
        "lists the runs it holds\n"
    )


@pytest.mark.parametrize("command", ["watch", "cancel"])
@pytest.mark.parametrize("run_id", ["", "run-x/", "run x", "a:b"])
def test_what_no_run_id_can_be_is_refused_naming_it(
    api: str, command: str, run_id: str, capsys: pytest.CaptureFixture
) -> None:
    """In the path such an id named another route: an empty one read as the run list ("does not serve the Runs
    API"), a slash was redirected, a colon read as an action of another run."""
    assert main([command, run_id, "--api", api]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"rlfleet: error: run id {run_id!r}: a run id is letters, digits and - _ . ~"), error


@pytest.mark.parametrize("source", ["--api", "$RLFLEET_API_URL", "fleet.json"])
def test_an_unanswered_address_says_where_it_came_from(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A stale fleet.json or variable would otherwise look like a fleet that is down."""
    nothing_there = f"http://127.0.0.1:{free_port()}"
    argv = ["runs", "--state-dir", str(tmp_path), "--timeout", "5"]
    if source == "--api":
        argv += ["--api", nothing_there]
    elif source == "$RLFLEET_API_URL":
        monkeypatch.setenv("RLFLEET_API_URL", nothing_there)
    else:
        record = {"pid": 1, "state": "up", "api_url": nothing_there, "processes": {}}
        (tmp_path / "fleet.json").write_text(json.dumps(record))
        source = f"api_url in {tmp_path / 'fleet.json'}"
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert f"the orchestrator at {nothing_there} did not answer" in error
    assert f"the address came from {source}" in error, error


def test_runs_shows_a_stalled_run_and_why(api: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["runs", "--api", api, "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["run-0119", "stalled"]
    assert out[2].split()[:2] == ["run-0118", "succeeded"]
    assert f"run-0119 stalled: {STALL}" in out


def test_watch_shows_a_stall_and_the_run_moving_again(api: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["watch", "run-0007", "--api", api]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"run-0007 stalled: {STALL}" in out and "run-0007 moving again" in out
    stalled_at = out.index(f"run-0007 stalled: {STALL}")
    assert out[stalled_at + 1].endswith("stalled") and "step 2/6" in out[stalled_at + 1]
    assert out[-1].endswith("succeeded")


def test_watch_off_a_terminal_prints_a_progress_line_only_when_it_changes(
    api: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["watch", "run-0008", "--api", api]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].split()[-1] for line in out] == ["1/6", "2/6", "6/6"]


def test_the_progress_line_says_how_many_eval_samples_failed() -> None:
    """Failed samples count as wrong answers: without the count, a failing fleet read as a worse model."""
    run = Run(id="run-1", progress=RunProgress(step=2, total_steps=6))
    run.evals.append(EvalResult(step=2, size=8, k=2, accuracy=0.25, failed=6))
    assert "eval acc 0.250 (6 of 16 eval samples failed)  weights" in progress_line(run)
    run.evals.append(EvalResult(step=4, size=8, k=2, accuracy=0.5))
    assert "eval acc 0.500  weights" in progress_line(run)


def test_a_watch_outlives_a_quiet_run_through_keepalives_but_not_a_silent_server(api: str) -> None:
    client = RunsClient(api)
    # 0.5 s of keep-alives only, each read waiting at most 0.3 s: the watch goes on to the run's end.
    assert [run.progress.step for run in client.watch("run-0007", timeout_s=0.3)] == [2, 2, 3, 6]
    with pytest.raises(Unavailable, match=r"nothing arrived for 0\.3 s, not even the keep-alive"):
        list(client.watch("run-0001", timeout_s=0.3))


def test_cancel_after_cancels_a_run_that_stays_quiet_past_its_time_and_spares_one_that_ended(api: str) -> None:
    client = RunsClient(api)
    # Keep-alives only after its first state: nothing a deadline checked between changes would ever see.
    with client.cancel_after("run-0012", 0.5) as due:
        states = [run.state for run in client.watch("run-0012", timeout_s=5)]
    assert due.is_set() and CANCELS == ["run-0012"]
    assert states == [RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_CANCELLED]
    with client.cancel_after("run-0007", 1.5) as due:
        assert [run.progress.step for run in client.watch("run-0007", timeout_s=5)][-1] == 6
    time.sleep(1.5)  # past the time it had
    assert not due.is_set() and CANCELS == ["run-0012"], "a run that ended within its time is left alone"


def test_commands_find_the_fleet_recorded_in_the_state_dir(
    api: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "fleet.json").write_text(json.dumps({"pid": 1, "state": "up", "api_url": api, "processes": {}}))
    assert main(["runs", "--state-dir", str(tmp_path), "--limit", "1"]) == 0
    assert listed_ids(capsys.readouterr().out) == ["run-0119"]


def test_submit_can_train_another_model_than_the_specs(api: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: .rlfleet/demo/sft}\nschedule: {steps: 6}\n")
    assert main(["submit", str(spec), "--api", api, "--model-path", "/models/tiny"]) == 0
    assert capsys.readouterr().out.strip() == "run-0500"
    assert SUBMITTED[-1] == {"model": {"path": "/models/tiny"}, "schedule": {"steps": 6}}


def test_submit_dry_run_prints_the_resolved_spec_as_yaml_and_submits_nothing(
    api: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: /models/tiny}\ndataset: {arithmetic: {}, seed: 7}\nschedule: {steps: 6}\n")
    submitted = len(SUBMITTED)
    assert main(["submit", str(spec), "--api", api, "--dry-run", "--model-path", "/models/other"]) == 0
    out = capsys.readouterr().out
    assert len(SUBMITTED) == submitted
    assert VALIDATED[-1] == {
        "model": {"path": "/models/other"},
        "dataset": {"arithmetic": {}, "seed": "7"},
        "schedule": {"steps": 6},
    }
    assert yaml.safe_load(out) == {
        "model": {"path": "/models/other"},
        "dataset": {"arithmetic": {}, "seed": 7},  # a uint64, a string in protobuf JSON, a number here
        "schedule": {"steps": 6},
        "rollout": {"function": "single_turn"},
    }
    assert out.splitlines()[-1] == (
        f"# {spec} is valid (the spec above is it with every default filled in); nothing was submitted"
    )
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(out)
    assert load_spec_file(resolved).rollout.function == "single_turn"  # the output is a spec file


def test_a_dry_run_of_an_invalid_spec_fails_as_its_submit_does(
    api: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: /models/tiny}\nschedule: {}\n")
    outcomes = []
    for dry_run in ([], ["--dry-run"]):
        code = main(["submit", str(spec), "--api", api, *dry_run])
        outcomes.append((code, *capsys.readouterr()))
    assert outcomes[1] == outcomes[0] == (2, "", f"rlfleet: error: HTTP 400: {NO_STEPS['message']}\n")


def test_dry_run_and_watch_together_are_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["submit", str(tmp_path / "spec.yaml"), "--watch", "--dry-run"])
    assert usage.value.code == 2
    assert "argument --dry-run: not allowed with argument --watch" in capsys.readouterr().err


def test_without_a_recorded_fleet_an_unanswered_default_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    nothing_there = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr("rlfleet.cli.runs.FALLBACK_URL", nothing_there)
    assert main(["runs", "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
    error = capsys.readouterr().err
    assert f"the orchestrator at {nothing_there} did not answer" in error
    assert f"No fleet is recorded in {tmp_path / 'fleet.json'}, so the default address was tried" in error
    assert f"`rlfleet up --state-dir {tmp_path}`" in error
    assert main(["runs", "--api", nothing_there, "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
    assert "No fleet is recorded" not in capsys.readouterr().err  # the address was the user's own choice


def test_a_fleet_whose_up_died_while_starting_is_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An `rlfleet up` killed while it made its model left its record "starting": this said "still starting, try
    again" for good."""
    monkeypatch.setattr("rlfleet.cli.runs.FALLBACK_URL", f"http://127.0.0.1:{free_port()}")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    record = {"pid": gone.pid, "state": "starting", "processes": {}, "started": {"up": 1}}
    (tmp_path / "fleet.json").write_text(json.dumps(record))
    assert main(["runs", "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
    error = capsys.readouterr().err
    assert f"the `rlfleet up` that was starting it (pid {gone.pid}) is gone" in error, error
    assert f"`rlfleet down --state-dir {tmp_path}`" in error and "still starting" not in error


def test_a_fleet_still_making_its_model_is_not_taken_for_the_default_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Before its services start, `rlfleet up` records itself without a Runs API: a submit then went to the
    default address, which may be another fleet's."""
    monkeypatch.setattr("rlfleet.cli.runs.FALLBACK_URL", f"http://127.0.0.1:{free_port()}")
    record_starting(tmp_path)
    try:
        for argv in (["runs"], ["cancel", "run-x"]):
            assert main([*argv, "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
            error = capsys.readouterr().err
            assert f"the fleet recorded in {tmp_path / 'fleet.json'} is still starting" in error, error
            assert "did not answer" not in error
        # Starting its services, the record names the Runs API that does not answer yet: said so, not "Connection
        # refused; the address came from api_url".
        record = json.loads((tmp_path / "fleet.json").read_text())
        record["api_url"] = f"http://127.0.0.1:{free_port()}"
        (tmp_path / "fleet.json").write_text(json.dumps(record))
        assert main(["runs", "--state-dir", str(tmp_path), "--timeout", "5"]) == 2
        error = capsys.readouterr().err
        assert "is still starting and its Runs API is not up yet" in error and "did not answer" not in error, error
    finally:
        remove_own_record(tmp_path)


def test_a_watch_reconnects_when_the_orchestrator_restarts(api: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["watch", "run-0009", "--api", api]) == 0
    captured = capsys.readouterr()
    assert WATCHES["run-0009"] == 3
    lines = captured.out.splitlines()
    assert lines[1] == "lost the watch of run-0009 (the orchestrator ended the watch); watching again for up to 60 s"
    steps = [line.split("  ")[0].split()[-1] for line in lines if line.startswith("run-0009 [")]
    assert steps == ["2/6", "3/6", "6/6"] and lines[-1].endswith("succeeded")


def test_a_watch_outlives_restarts_further_apart_than_its_reconnect_window(api: str) -> None:
    """Each restart gets the window anew once a watch held for it. Before, a quiet run's window counted from the
    first restart on: the second one, 1.2 s later, gave up at once with a 1 s window."""
    client = RunsClient(api, timeout_s=5)
    lost: list[str] = []
    runs = list(client.follow("run-0013", reconnect_within_s=1.0, on_lost=lost.append))
    assert runs[-1].state == RunState.RUN_STATE_SUCCEEDED
    assert WATCHES["run-0013"] == QUIET_RESTARTS + 1 and len(lost) == QUIET_RESTARTS, lost


@pytest.mark.parametrize("command", [["watch", "run-0010"], ["submit", "SPEC", "--watch"]])
def test_a_watch_that_cannot_be_kept_up_says_where_the_run_was_with_exit_code_3(
    api: str, tmp_path: Path, command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: /models/tiny}\nschedule: {steps: 6}\n")
    monkeypatch.setattr("rlfleet.cli.runs.WATCH_RECONNECT_S", 1.0)
    started = time.monotonic()
    assert main([word.replace("SPEC", str(spec)) for word in command] + ["--api", api]) == 3
    assert time.monotonic() - started < 10
    run_id = command[1] if command[0] == "watch" else "run-0500"
    out, error = capsys.readouterr()
    assert f"lost the watch of {run_id} (the orchestrator ended the watch); watching again for up to 1 s" in out
    assert f"the watch ended while {run_id} is RUNNING at step 2" in error
    # The command that follows it again finds the same fleet (it named the wrong one without the flag).
    assert f"`rlfleet watch {run_id} --api {api}` follows it again" in error


def test_ctrl_c_on_a_watch_says_the_run_goes_on_and_how_to_follow_it_again(
    api: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """It said "interrupted" alone, which reads as the run stopped too."""

    def follow(self: RunsClient, run_id: str, *args: object, **kwargs: object) -> Iterator[Run]:
        yield Run(id=run_id, state=RunState.RUN_STATE_RUNNING, progress=RunProgress(step=1, total_steps=6))
        raise KeyboardInterrupt

    monkeypatch.setattr(RunsClient, "follow", follow)
    assert main(["watch", "run-0007", "--api", api]) == 130
    out, error = capsys.readouterr()
    assert "step 1/6" in out
    assert error == (
        f"\nstopped watching run-0007; the run goes on: `rlfleet watch run-0007 --api {api}` follows it again, "
        f"`rlfleet cancel run-0007 --api {api}` cancels it\n"
    )


def test_a_watch_that_goes_silent_says_it_was_lost_and_how_long_it_tries_again(
    api: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A hung orchestrator is noticed only after the read timeout: the watch says so then, not only at its end."""
    monkeypatch.setattr("rlfleet.runs_client.WATCH_READ_TIMEOUT_S", 0.3)
    assert main(["watch", "run-0001", "--api", api]) == 0  # silent after its first event; it ended meanwhile
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        f"lost the watch of run-0001 (nothing arrived for 0.3 s, not even the keep-alive the orchestrator at {api} "
        "sends while a run is quiet); watching again for up to 60 s"
    )
    assert out[-1].endswith("succeeded")


def test_a_watch_of_a_server_that_never_answers_fails_within_its_timeout_saying_so() -> None:
    """A server that accepts connections but never answers: the watch never starts, and --timeout bounds that."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections are accepted by the kernel, and never answered
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        watch = subprocess.run(
            [sys.executable, "-m", "rlfleet.cli", "watch", "run-0001", "--api", url, "--timeout", "2"],
            capture_output=True,
            text=True,
            timeout=40,
        )
    assert time.monotonic() - started < 20
    assert watch.returncode == 2, watch.stdout + watch.stderr
    assert (
        f"the watch of run-0001 never started: the orchestrator at {url} accepted the connection but did not "
        "answer within 2 s" in watch.stderr
    )
    assert "lost the watch" not in watch.stderr
