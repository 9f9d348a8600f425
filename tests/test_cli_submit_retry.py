"""`rlfleet submit` retries a Submit without making a second run: each invocation sends a fresh UUID4 request_id,
and sends the Submit again with that same request_id when the answer is lost (the server stored the run and
dropped the connection), late (past --timeout) or a 5xx, within a bound; an answer a retry cannot change (a 400,
a 409) is not retried. The fake Runs API de-duplicates by request_id as the orchestrator does."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from rlfleet.cli.main import main


@dataclass
class FakeRunsApi:
    """What the fake does with each POST /v1/runs, in order (then it answers): `drop` (store the run, close the
    connection unanswered), `late` (store the run, answer after `late_s`), `503`, `409`."""

    script: list[str] = field(default_factory=list)
    late_s: float = 3.0
    request_ids: list[str | None] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)
    """request_id (or a fresh key for a POST without one) -> the run id it made."""


def handler_for(api: FakeRunsApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            request_id = parse_qs(urlsplit(self.path).query).get("request_id", [None])[0]
            api.request_ids.append(request_id)
            action = api.script.pop(0) if api.script else "answer"
            if action in ("503", "409"):
                message = "reward hub down" if action == "503" else "request_id: already used by another spec"
                return self.answer(int(action), {"error": {"message": message}})
            run_id = api.runs.setdefault(request_id or uuid.uuid4().hex, f"run-{len(api.runs):04d}")
            if action == "drop":
                self.close_connection = True  # the run is stored; the answer is lost
                return None
            if action == "late":
                time.sleep(api.late_s)
            return self.answer(200, {"id": run_id, "state": "RUN_STATE_QUEUED"})

        def answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up waiting (`late`)
                pass

    return Handler


@pytest.fixture
def api() -> Iterator[tuple[FakeRunsApi, str]]:
    fake = FakeRunsApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(fake))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("RLFLEET_API_URL", raising=False)
    monkeypatch.setattr("rlfleet.runs_client.SUBMIT_BACKOFF_S", (0.05, 0.2))
    path = tmp_path / "spec.yaml"
    path.write_text("model: {path: /models/tiny}\nschedule: {steps: 6}\n")
    return path


def submit(spec: Path, url: str, *more: str) -> int:
    return main(["submit", str(spec), "--api", url, "--state-dir", str(spec.parent), *more])


def is_uuid4(text: str | None) -> bool:
    return text is not None and str(uuid.UUID(text, version=4)) == text


@pytest.mark.parametrize("lost", ["drop", "late", "503"])
def test_a_submit_whose_answer_is_lost_late_or_a_5xx_is_sent_again_with_its_request_id_and_makes_one_run(
    api: tuple[FakeRunsApi, str], spec: Path, lost: str, capsys: pytest.CaptureFixture
) -> None:
    fake, url = api
    fake.script = [lost]
    assert submit(spec, url, "--timeout", "1") == 0
    out, err = capsys.readouterr()
    assert len(fake.request_ids) == 2
    assert fake.request_ids[0] == fake.request_ids[1] and is_uuid4(fake.request_ids[0])
    assert out == "run-0000\n"
    assert len(fake.runs) == 1  # without the request_id the retry would have made run-0001
    assert err.startswith("submit: ")
    assert f"sending it again with request_id {fake.request_ids[0]} for up to 30 s" in err


def test_each_invocation_sends_a_fresh_request_id(api: tuple[FakeRunsApi, str], spec: Path) -> None:
    fake, url = api
    assert submit(spec, url) == 0
    assert submit(spec, url) == 0
    assert len(set(fake.request_ids)) == 2 and all(is_uuid4(r) for r in fake.request_ids)
    assert len(fake.runs) == 2


def test_a_conflict_is_not_retried(api: tuple[FakeRunsApi, str], spec: Path, capsys: pytest.CaptureFixture) -> None:
    fake, url = api
    fake.script = ["409"]
    assert submit(spec, url) == 2
    assert len(fake.request_ids) == 1
    assert capsys.readouterr().err == "rlfleet: error: HTTP 409: request_id: already used by another spec\n"


def test_the_retries_of_a_submit_end_within_their_bound(
    api: tuple[FakeRunsApi, str], spec: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    fake, url = api
    fake.script = ["503"] * 1000
    monkeypatch.setattr("rlfleet.runs_client.SUBMIT_RETRY_S", 1.0)
    started = time.monotonic()
    assert submit(spec, url) == 2
    assert time.monotonic() - started < 5
    assert len(set(fake.request_ids)) == 1 and len(fake.request_ids) >= 3
    assert fake.runs == {}
    assert capsys.readouterr().err.endswith("rlfleet: error: HTTP 503: reward hub down\n")


def test_a_dry_run_sends_no_request_id(api: tuple[FakeRunsApi, str], spec: Path) -> None:
    fake, url = api
    submit(spec, url, "--dry-run")  # the fake answers a Run, not a resolved spec: only what it was sent matters
    assert fake.request_ids == [None]
