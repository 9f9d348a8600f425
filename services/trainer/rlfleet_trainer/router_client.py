"""Asks the router to make every engine serve a weight version (the router fans it out)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from rlfleet.api_token import bearer_headers
from rlfleet.errors import Conflict, Unavailable

logger = logging.getLogger(__name__)


class RouterClient:
    def __init__(self, base_url: str, timeout_s: float, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = bearer_headers(token)

    def load_weights(self, model_path: str, version: int, *, abort_all_requests: bool = False) -> None:
        """POST /update_weights_from_disk (see `post` for retries and failures).

        `abort_all_requests` (SGLang's field, passed through by the router's fan-out) has every engine
        abort its generations first, answering them with the old version: rollout.on_weight_update
        "abort_resume" then resumes them on the new one.

        A load some engines failed is done all the same once the router's 502 says the fleet serves `version`
        (those engines left routing and load it before they rejoin): sent again, it would have every other
        engine load the same version twice. Logged at warning, naming the engines taken out."""
        body: dict[str, object] = {"model_path": model_path, "weight_version": str(version)}
        if abort_all_requests:
            body["abort_all_requests"] = True
        answer = self.post(
            "/update_weights_from_disk",
            body,
            f"load weight version {version} from {model_path}",
            settled=lambda status, payload: status == 502 and payload.get("weight_version") == str(version),
        )
        if answer.get("success") is False:
            engines = answer.get("engines")
            failed = [str(e.get("url")) for e in engines or [] if isinstance(e, dict) and not e.get("success")]
            logger.warning(
                "weight version %d loaded by part of the fleet: %s (taken out of routing: %s)",
                version,
                answer.get("message"),
                ", ".join(failed) or "not named",
            )

    def served_version(self, timeout_s: float) -> str | None:
        """The weight version the router says the fleet serves (GET /weight_version): None when it knows none
        (it restarted since the last load). Unavailable when it does not answer within `timeout_s`, or not as
        the router would."""
        url = f"{self.base_url}/weight_version"
        try:
            response = httpx.get(url, headers=self.headers, timeout=timeout_s)
            payload = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            raise Unavailable(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(payload, dict) or "weight_version" not in payload:
            raise Unavailable(f"GET {url} answered HTTP {response.status_code}: {response.text[:200]!r}")
        version = payload["weight_version"]
        return None if version is None else str(version)

    def post(
        self,
        path: str,
        body: dict[str, object],
        what: str,
        *,
        settled: Callable[[int, dict[str, Any]], bool] | None = None,
    ) -> dict[str, Any]:
        """POSTs `body` to the router's `path` and returns its JSON answer; `what` says what the call does,
        for errors ("load weight version 3 from ...").

        Retries connection errors and 5xx with backoff until `timeout_s` has passed, then raises
        Unavailable; fails at once with Unavailable on a 4xx or an explicit `success: false`, and with
        Conflict on an answer that is not a JSON object (not the router: a proxy's page, a wrong URL).
        A JSON answer that `settled(status, answer)` accepts is returned as it is, whatever its status: an
        outcome the caller reads, which a retry would not change."""
        url = f"{self.base_url}{path}"
        deadline = time.monotonic() + self.timeout_s
        delay = 0.5
        last = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"router at {self.base_url} did not {what}: {last}")
            try:
                response = httpx.post(url, json=body, headers=self.headers, timeout=min(remaining, 120.0))
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                payload = _json_object(response)
                if settled is not None and payload is not None and settled(response.status_code, payload):
                    return payload
                if response.status_code < 500:
                    return _answer(url, response, what)
                last = f"HTTP {response.status_code} {response.text[:300]}"
            logger.warning("router call to %s failed (%s); retrying", what, last)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 5.0)


def _json_object(response: httpx.Response) -> dict[str, Any] | None:
    """The answer's JSON object ({} for an empty body), or None if it is not one."""
    try:
        payload = response.json() if response.content else {}
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _answer(url: str, response: httpx.Response, what: str) -> dict[str, Any]:
    payload = _json_object(response)
    if payload is None:
        raise Conflict(
            f"POST {url} answered HTTP {response.status_code} with no JSON object, so it is not the router "
            f"(check the trainer's router_url): {response.text[:200]!r}"
        )
    if response.status_code == 200 and payload.get("success", True):
        return payload
    raise Unavailable(
        f"router refused to {what}: HTTP {response.status_code} {payload.get('message') or response.text[:500]}"
    )
