"""Asks the router to make every engine serve a weight version (the router fans it out)."""

from __future__ import annotations

import logging
import time

import httpx

from rlfleet.api_token import bearer_headers
from rlfleet.errors import Unavailable

logger = logging.getLogger(__name__)


class RouterClient:
    def __init__(self, base_url: str, timeout_s: float, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = bearer_headers(token)

    def load_weights(self, model_path: str, version: int, *, abort_all_requests: bool = False) -> None:
        """POST /update_weights_from_disk; retries connection errors and 5xx with backoff until the
        overall deadline, fails at once on a 4xx or an explicit `success: false`.

        `abort_all_requests` (SGLang's field, passed through by the router's fan-out) has every engine
        abort its generations first, answering them with the old version: rollout.on_weight_update
        "abort_resume" then resumes them on the new one."""
        body: dict[str, object] = {"model_path": model_path, "weight_version": str(version)}
        if abort_all_requests:
            body["abort_all_requests"] = True
        deadline = time.monotonic() + self.timeout_s
        delay = 0.5
        last = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"router at {self.base_url} did not load weight version {version}: {last}")
            try:
                response = httpx.post(
                    f"{self.base_url}/update_weights_from_disk",
                    json=body,
                    headers=self.headers,
                    timeout=min(remaining, 120.0),
                )
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 500:
                    payload = response.json() if response.content else {}
                    if response.status_code == 200 and payload.get("success", True):
                        return
                    raise Unavailable(
                        f"router refused weight version {version} from {model_path}: "
                        f"HTTP {response.status_code} {payload.get('message') or response.text[:500]}"
                    )
                last = f"HTTP {response.status_code} {response.text[:300]}"
            logger.warning("loading weight version %d through the router failed (%s); retrying", version, last)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 5.0)
