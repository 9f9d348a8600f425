"""A small client of the orchestrator's REST Runs API, used by the CLI and the demo.

Requests and responses are the protobuf JSON of runs.proto, parsed back into messages so callers
get typed values (int64 fields arrive as JSON strings).
"""

from __future__ import annotations

import builtins  # `list` names a method in RunsClient's scope
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml
from google.protobuf import json_format

from rlfleet.api_token import bearer_headers
from rlfleet.errors import (
    Conflict,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    RlfleetError,
    Unauthenticated,
    Unavailable,
)
from rlfleet.proto_parse_errors import describe_parse_error
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState

STATUS_ERRORS: dict[int, type[RlfleetError]] = {400: InvalidInput, 401: Unauthenticated, 404: NotFound, 409: Conflict}
FINAL_STATES = (RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED, RunState.RUN_STATE_CANCELLED)
WATCH_READ_TIMEOUT_S = 60.0
"""How long a watch waits for its next line. The orchestrator sends an event per change and a keep-alive
comment when the run is quiet (every 15 s by default, RLFLEET_ROLLOUT_WATCH_KEEPALIVE_S), so silence this
long means the orchestrator or the connection is gone, not that the run is queued or slow."""
LIST_PAGE_SIZE = 1000
"""The orchestrator's largest page: listing every run takes the fewest requests."""


def load_spec_file(path: Path) -> RunSpec:
    """A RunSpec from a JSON or YAML file; unknown fields and wrong types name the field."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidInput(f"cannot read run spec {path}: {exc}") from exc
    try:
        data = yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{path} is not valid {'YAML' if Path(path).suffix != '.json' else 'JSON'}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} must hold a mapping of RunSpec fields, got {type(data).__name__}")
    try:
        return json_format.ParseDict(data, RunSpec())
    except json_format.ParseError as exc:
        raise InvalidInput(f"{path}: {describe_parse_error(str(exc), 'spec')}") from exc


class RunsClient:
    def __init__(
        self, base_url: str, timeout_s: float = 30.0, token: str | None = None, unreachable_hint: str = ""
    ) -> None:
        """`unreachable_hint` ends the error raised when nothing answers at `base_url` (e.g. how it was chosen)."""
        self.base_url = base_url.rstrip("/")
        self.unreachable_hint = unreachable_hint
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=bearer_headers(token))

    def close(self) -> None:
        self.http.close()

    def submit(self, spec: RunSpec) -> Run:
        return self._run(self._request("POST", "/v1/runs", json=json_format.MessageToDict(spec)))

    def get(self, run_id: str) -> Run:
        return self._run(self._request("GET", f"/v1/runs/{run_id}"))

    def list(self, state: str | None = None) -> list[Run]:
        """Every run (in `state`, if given), oldest first, page after page."""
        runs, token = self.page(state, LIST_PAGE_SIZE)
        while token:
            more, token = self.page(state, LIST_PAGE_SIZE, token)
            runs.extend(more)
        return runs

    def page(
        self, state: str | None = None, page_size: int = 0, page_token: str = ""
    ) -> tuple[builtins.list[Run], str]:
        """One page of runs, oldest first, and the token of the next page ("" after the last)."""
        params: dict[str, str | int] = {"page_size": page_size, "page_token": page_token}
        if state:
            params["state"] = state
        body = self._request("GET", "/v1/runs", params=params)
        runs = [json_format.ParseDict(r, Run(), ignore_unknown_fields=True) for r in body.get("runs", [])]
        return runs, str(body.get("next_page_token", ""))

    def wait_final(self, run_id: str, timeout_s: float, poll_s: float = 0.5) -> Run:
        """The run once it has ended (succeeded, failed or cancelled); DeadlineExceeded after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (run := self.get(run_id)).state not in FINAL_STATES:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"run {run_id} had not ended after {timeout_s:g}s: {RunState.Name(run.state)} at step "
                    f"{run.progress.step}"
                )
            time.sleep(poll_s)
        return run

    def cancel(self, run_id: str) -> Run:
        return self._run(self._request("POST", f"/v1/runs/{run_id}:cancel"))

    def watch(self, run_id: str, timeout_s: float = WATCH_READ_TIMEOUT_S) -> Iterator[Run]:
        """The run now, then every change, until it ends; each read waits at most `timeout_s` (keep-alive
        comments count: a quiet run is not a lost watch)."""
        try:
            with self.http.stream("GET", f"/v1/runs/{run_id}:watch", timeout=timeout_s) as response:
                if response.status_code != 200:
                    response.read()
                    self._raise_for(response)
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        yield json_format.Parse(line[5:].strip(), Run(), ignore_unknown_fields=True)
        except httpx.ReadTimeout as exc:
            raise Unavailable(
                f"lost the watch of run {run_id} at {self.base_url}: nothing arrived for {timeout_s:g} s, not even "
                "the keep-alive the orchestrator sends while a run is quiet"
            ) from exc
        except httpx.TransportError as exc:
            lost = f"lost the watch of run {run_id} at {self.base_url}: {exc}"
            raise Unavailable(lost + self.unreachable_hint) from exc

    def _run(self, body: dict) -> Run:
        return json_format.ParseDict(body, Run(), ignore_unknown_fields=True)

    def _request(self, method: str, path: str, **kwargs: object) -> dict:
        try:
            response = self.http.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.TransportError as exc:
            silent = f"the orchestrator at {self.base_url} did not answer: {exc}"
            raise Unavailable(silent + self.unreachable_hint) from exc
        self._raise_for(response)
        return response.json()

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        status = response.status_code
        error = STATUS_ERRORS.get(status, Unavailable if status >= 500 else RlfleetError)
        raise error(f"HTTP {status}: {message}")
