"""A small client of the orchestrator's REST Runs API, used by the CLI and the demo.

Requests and responses are the protobuf JSON of runs.proto, parsed back into messages so callers
get typed values (int64 fields arrive as JSON strings). `follow` keeps a watch up across orchestrator
restarts (the orchestrator ends its watch streams when it stops; `rlfleet up` starts it again in seconds).
"""

from __future__ import annotations

import builtins  # `list` names a method in RunsClient's scope
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from rlfleet.api_token import TOKEN_ENV, TOKEN_FILE_ENV, bearer_headers
from rlfleet.errors import (
    Conflict,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    RlfleetError,
    Unauthenticated,
    Unavailable,
)
from rlfleet.proto_parse_errors import parse_json_message
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState

logger = logging.getLogger(__name__)


class RunNotFound(NotFound):
    """The orchestrator holds no run of the id asked for (a server without the Runs API's routes is a NotFound of
    its own, naming the address)."""


STATUS_ERRORS: dict[int, type[RlfleetError]] = {
    400: InvalidInput,
    401: Unauthenticated,
    404: RunNotFound,  # the orchestrator's 404 on every route of the Runs API, once other servers' are told apart
    409: Conflict,
}
FINAL_STATES = (RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED, RunState.RUN_STATE_CANCELLED)
WATCH_READ_TIMEOUT_S = 60.0
"""How long a watch waits for its next line. The orchestrator sends an event per change and a keep-alive
comment when the run is quiet (every 15 s by default, RLFLEET_ROLLOUT_WATCH_KEEPALIVE_S), so silence this
long means the orchestrator or the connection is gone, not that the run is queued or slow."""
WATCH_RECONNECT_S = 60.0
"""How long `follow` keeps trying to watch again after the orchestrator ended the watch, could not be reached
or fell silent, counted from the first failure since the run last changed (a silent one is noticed only
WATCH_READ_TIMEOUT_S after its last line): `rlfleet up` restarts a stopped orchestrator after 1-4 s of backoff,
and it answers again once it has started (seconds)."""
RECONNECT_BACKOFF_S = (0.5, 5.0)
"""First and largest wait between attempts to watch again; each wait doubles the one before."""
SUBMIT_RETRY_S = 30.0
"""How long `submit` sends a Submit again while it fails in a way a retry can fix (an orchestrator `rlfleet up`
restarts answers again within seconds); each repeat carries the first one's request_id, so none makes a second
run."""
SUBMIT_BACKOFF_S = (0.5, 4.0)
"""First and largest wait between attempts of a Submit; each wait doubles the one before."""
INT64_TYPES = frozenset({FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64})
LIST_PAGE_SIZE = 1000
"""The orchestrator's largest page: listing every run takes the fewest requests."""


class SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading exponents as YAML 1.2 and JSON do: YAML 1.1 takes `1e-6` (no dot) for a
    string, which a typed field converts but a reward's free-form params would pass on as text."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_spec_file(path: Path) -> RunSpec:
    """A RunSpec from a file: JSON if it is named *.json, else YAML (whose flow style reads JSON too, so a JSON
    spec under any other name parses as well); unknown fields and wrong types name the field."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidInput(f"cannot read run spec {path}: {exc}") from exc
    as_json = Path(path).suffix == ".json"
    try:
        data = json.loads(text) if as_json else yaml.load(text, SpecLoader)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{path} is not valid {'JSON' if as_json else 'YAML'}: {exc}") from exc
    except RecursionError:
        raise InvalidInput(f"{path} is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} must hold a mapping of RunSpec fields, got {type(data).__name__}")
    try:
        return parse_json_message(data, RunSpec(), "spec")
    except InvalidInput as exc:
        raise InvalidInput(f"{path}: {exc}") from None


def spec_yaml(spec: RunSpec) -> str:
    """`spec` as a YAML spec file, in the field names `load_spec_file` reads back; 64-bit integers (seeds) as
    numbers, not the strings of their protobuf JSON."""
    return yaml.safe_dump(
        _plain_ints(spec, json_format.MessageToDict(spec, preserving_proto_field_name=True)), sort_keys=False
    )


def _plain_ints(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    """`data`, the protobuf JSON of `message`, with the 64-bit integers that JSON holds as strings made ints."""
    for field, value in message.ListFields():
        if field.name not in data:
            continue
        if field.cpp_type in INT64_TYPES:
            data[field.name] = [int(v) for v in data[field.name]] if field.is_repeated else int(data[field.name])
        elif field.message_type is not None and not field.message_type.file.name.startswith("google/protobuf/"):
            if field.message_type.GetOptions().map_entry:
                continue
            pairs = zip(value, data[field.name], strict=True) if field.is_repeated else [(value, data[field.name])]
            for item, part in pairs:
                _plain_ints(item, part)
    return data


_RUN_ID = re.compile(r"[A-Za-z0-9._~-]+")


def run_path(run_id: str, action: str = "") -> str:
    """The Runs API path of a run (and an action such as `:cancel`); InvalidInput for what no run id can be, which
    in a path would name another route (an empty id lists runs, a slash is redirected)."""
    if not _RUN_ID.fullmatch(run_id):
        raise InvalidInput(
            f"run id {run_id!r}: a run id is letters, digits and - _ . ~ (such as run-3f2a9c1b7d4e; `rlfleet runs` "
            "lists them)"
        )
    return f"/v1/runs/{run_id}{action}"


class WatchEnded(Unavailable):
    """The watch could not be kept up while the run went on; `run` is the run as last seen."""

    def __init__(self, run: Run, why: str) -> None:
        self.run = run
        self.why = why
        self.follow_again = f"rlfleet watch {run.id}"
        """The command that follows the run again (a CLI adds the flags that found its fleet)."""
        super().__init__(why)

    def __str__(self) -> str:
        state = RunState.Name(self.run.state).removeprefix("RUN_STATE_")
        return (
            f"the watch ended while {self.run.id} is {state} at step {self.run.progress.step} ({self.why}); the run "
            f"may go on: `{self.follow_again}` follows it again"
        )


class RunsClient:
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 30.0,
        token: str | None = None,
        unreachable_hint: str = "",
        not_runs_api_hint: str = "",
    ) -> None:
        """`base_url` without a scheme (`localhost:8000`) is taken as http://. `timeout_s` bounds connecting and
        each answer (for a watch: its first answer, see `follow`); `unreachable_hint` ends the error raised when
        nothing answers at `base_url` (e.g. how it was chosen), `not_runs_api_hint` the one raised when another
        server answers there (a router's or reward hub's URL given for the orchestrator's)."""
        self.base_url = (base_url if "://" in base_url else f"http://{base_url}").rstrip("/")
        self.timeout_s = timeout_s
        self.unreachable_hint = unreachable_hint
        self.not_runs_api_hint = not_runs_api_hint
        try:
            url = httpx.URL(self.base_url)
            if url.scheme not in ("http", "https"):
                raise httpx.InvalidURL(f"the scheme is {url.scheme!r}, not http or https")
            if url.port is not None and not 1 <= url.port <= 65535:
                raise httpx.InvalidURL(f"port {url.port} is outside 1-65535")
            self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=bearer_headers(token))
        except httpx.InvalidURL as exc:
            raise InvalidInput(f"{base_url!r} is not an address of the Runs API ({exc}){unreachable_hint}") from exc

    def close(self) -> None:
        self.http.close()

    def submit(
        self,
        spec: RunSpec,
        *,
        validate_only: bool = False,
        request_id: str | None = None,
        retry_within_s: float | None = None,
        on_retry: Callable[[str], None] | None = None,
    ) -> Run:
        """The run as stored; with `validate_only`, the run the orchestrator would create after every check of a
        submit, without an id (nothing is stored).

        A Submit carries a request_id (AIP-155; `request_id`, else a fresh UUID4) and is sent again with the same
        one, with backoff, while it fails in a way a retry can fix (nothing answered, no answer within the
        timeout, a 5xx) for up to `retry_within_s` (default SUBMIT_RETRY_S) from the first attempt (an attempt
        started then may take the client's timeout more): the orchestrator answers a repeat with the run the
        first one created, so a Submit whose answer was lost never makes a second run. `on_retry` is told of the
        first failure."""
        params = {"validate_only": "true"} if validate_only else {"request_id": request_id or str(uuid.uuid4())}
        body = json_format.MessageToDict(spec)
        retry_within_s = SUBMIT_RETRY_S if retry_within_s is None else retry_within_s
        deadline = time.monotonic() + retry_within_s
        wait, longest = SUBMIT_BACKOFF_S
        told = on_retry is None
        while True:
            try:
                return self._run(self._request("POST", "/v1/runs", json=body, params=params))
            except Unavailable as exc:
                if time.monotonic() + wait > deadline:
                    raise
                if not told and on_retry is not None:
                    again = f" with request_id {params['request_id']}" if "request_id" in params else ""
                    on_retry(f"submit: {exc}; sending it again{again} for up to {retry_within_s:g} s")
                    told = True
            time.sleep(wait)
            wait = min(2 * wait, longest)

    def get(self, run_id: str) -> Run:
        return self._run(self.get_json(run_id))

    def get_json(self, run_id: str) -> dict[str, Any]:
        """The run as the API's JSON, fields this client does not know included (an orchestrator newer than it)."""
        return self._request("GET", run_path(run_id))

    def list(self, state: str | None = None) -> list[Run]:
        """Every run (in `state`, if given), oldest first, page after page. An answer naming a page already read
        as the next one is Unavailable: paging on would never end (a proxy caching the listing's answer, say)."""
        runs, token = self.page(state, LIST_PAGE_SIZE)
        read: set[str] = set()
        while token:
            if token in read:
                raise Unavailable(
                    f"{self.base_url}/v1/runs named page {token[:64]!r} as the next page again after {len(runs)} runs; "
                    "is a proxy or cache answering in the orchestrator's place?"
                )
            read.add(token)
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
        return self._run(self._request("POST", run_path(run_id, ":cancel")))

    @contextlib.contextmanager
    def cancel_after(self, run_id: str, seconds: float) -> Iterator[threading.Event]:
        """Cancels `run_id` if the block is still running `seconds` from now, however quiet the run is (a watch
        of it then sees it end CANCELLED); the event it yields is set once that time came. A run may stall without a
        change a watch would show, and keep-alives keep its watch up: a deadline checked only as changes arrive
        would never come."""
        due = threading.Event()

        def cancel() -> None:
            due.set()
            try:
                self.cancel(run_id)
            except RlfleetError as exc:  # it ended meanwhile, or the orchestrator is away: the watch says which
                logger.warning("could not cancel run %s after %g s: %s", run_id, seconds, exc)

        timer = threading.Timer(seconds, cancel)
        timer.daemon = True
        timer.start()
        try:
            yield due
        finally:
            timer.cancel()

    def watch(self, run_id: str, timeout_s: float = WATCH_READ_TIMEOUT_S) -> Iterator[Run]:
        """The run now, then its latest state after each change (changes back to back may come as one), until it
        ends; each read waits at most `timeout_s` (keep-alive comments count: a quiet run is not a lost watch)."""
        try:
            with self.http.stream("GET", run_path(run_id, ":watch"), timeout=timeout_s) as response:
                if response.status_code != 200:
                    response.read()
                    self._raise_for(response)
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        yield json_format.Parse(line[5:].strip(), Run(), ignore_unknown_fields=True)
        except httpx.ReadTimeout as exc:
            raise Unavailable(
                f"nothing arrived for {timeout_s:g} s, not even the keep-alive the orchestrator at {self.base_url} "
                "sends while a run is quiet"
            ) from exc
        except httpx.TransportError as exc:
            raise Unavailable(f"the connection to {self.base_url} failed: {exc}{self.unreachable_hint}") from exc

    def follow(
        self,
        run_id: str,
        reconnect_within_s: float = WATCH_RECONNECT_S,
        on_lost: Callable[[str], None] | None = None,
    ) -> Iterator[Run]:
        """The run now, then its latest state after each change, until it ends, across restarts of the
        orchestrator: a watch that ends or fails before the run did is started again, with backoff, for up to
        `reconnect_within_s` from the first failure since a watch last worked (brought a change, or stayed up that
        long); then WatchEnded.
        `on_lost` is told of that first failure (a line saying why and how long the watch is tried again): a silent
        orchestrator is noticed only after WATCH_READ_TIMEOUT_S, and the watch would otherwise say nothing for
        minutes. Each watch starts only once the orchestrator has answered a plain read within the client's
        timeout, so one that accepts connections but never answers fails that fast (a running watch may stay quiet
        for WATCH_READ_TIMEOUT_S). A new watch first repeats the run as it is then: that is yielded only if it
        differs from the last run yielded."""
        try:
            last = self.get(run_id)
        except Unavailable as exc:
            raise Unavailable(f"the watch of {run_id} never started: {exc}") from exc
        lost_since: float | None = None
        shown: Run | None = None
        while True:
            started = time.monotonic()
            try:
                for run in self.watch(run_id, WATCH_READ_TIMEOUT_S):
                    if run != last:  # the run moved, so the watch works (each watch first repeats the run)
                        lost_since = None
                    last = run
                    if run == shown:  # a new watch's repeat of the run, unchanged since the last one showed it
                        continue
                    shown = run
                    yield run
                    if run.state in FINAL_STATES:
                        return
                why = "the orchestrator ended the watch"
            except Unavailable as exc:  # unreachable, 5xx while it starts, or silent
                why = str(exc)
            if time.monotonic() - started >= reconnect_within_s:  # a quiet run's watch that held: a new loss
                lost_since = None
            if lost_since is None and on_lost is not None:
                on_lost(f"lost the watch of {run_id} ({why}); watching again for up to {reconnect_within_s:g} s")
            lost_since = lost_since or time.monotonic()
            now = self._read_again(run_id, last, why, lost_since + reconnect_within_s, reconnect_within_s)
            if now.state in FINAL_STATES:  # it ended while no watch was up
                yield now
                return

    def _read_again(self, run_id: str, last: Run, why: str, deadline: float, within_s: float) -> Run:
        """The run as soon as the orchestrator answers again, asked with growing waits in between; WatchEnded
        (with `why`, the latest failure) if it has not by `deadline`."""
        wait, longest = RECONNECT_BACKOFF_S
        while time.monotonic() < deadline:
            time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(2 * wait, longest)
            try:
                return self.get(run_id)
            except Unavailable as exc:
                why = str(exc)
        raise WatchEnded(last, f"{why}; no watch again within {within_s:g} s")

    def _run(self, body: dict) -> Run:
        return json_format.ParseDict(body, Run(), ignore_unknown_fields=True)

    def _request(self, method: str, path: str, **kwargs: object) -> dict:
        try:
            response = self.http.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.ReadTimeout as exc:
            silent = f"the orchestrator at {self.base_url} accepted the connection but did not answer within "
            raise Unavailable(f"{silent}{self.timeout_s:g} s{self.unreachable_hint}") from exc
        except httpx.TransportError as exc:
            if _not_http1(exc):
                raise RlfleetError(
                    f"{self.base_url} does not serve the Runs API: it answered in something other than HTTP/1.1 "
                    f"({exc}), as a gRPC port does (the Runs API's REST port is another)" + self.not_runs_api_hint
                ) from exc
            silent = f"the orchestrator at {self.base_url} did not answer: {exc}"
            raise Unavailable(silent + self.unreachable_hint) from exc
        self._raise_for(response)
        try:
            return response.json()
        except ValueError as exc:  # a web server of another kind answered
            request = response.request
            raise RlfleetError(
                f"{self.base_url} does not serve the Runs API ({request.method} {request.url.path} answered "
                f"{response.status_code} with something other than JSON)" + self.not_runs_api_hint
            ) from exc

    def _raise_for(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            message = str(response.json()["error"]["message"])
            ours = True
        except (ValueError, KeyError, TypeError):
            message, ours = response.text[:500], False
        status = response.status_code
        # The orchestrator serves every route of the Runs API: its 404 is for a run it does not hold, while a
        # router or reward hub says the path is not theirs, and another server answers in words of its own.
        if status == 404 and (not ours or message.endswith(": no such path")):
            request = response.request
            raise NotFound(
                f"{self.base_url} does not serve the Runs API ({request.method} {request.url.path} answered 404)"
                + self.not_runs_api_hint
            )
        error = STATUS_ERRORS.get(status, Unavailable if status >= 500 else RlfleetError)
        if status == 401:  # the server names its header; the client's user sets the token elsewhere
            message += f" (the token sent is read from --api-token-file, ${TOKEN_FILE_ENV}, or ${TOKEN_ENV})"
        raise error(f"HTTP {status}: {message}")


def _not_http1(exc: BaseException) -> bool:
    """Whether the server's answer broke HTTP/1.1 (h11 refused its bytes), rather than the connection failing."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, h11.RemoteProtocolError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False
