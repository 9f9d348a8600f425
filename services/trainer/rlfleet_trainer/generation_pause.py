"""Fleet-wide generation pause (through the router) while engines hold part of a weight version, and its end.

A pause that is never lifted leaves every engine holding its requests until the router's pause bound has
passed (the router then lifts it itself): a whole weight-load timeout without generation. So the end of a
pause is not one best-effort call: `/continue_generation` is sent again with backoff, within the
router client's bound, until every engine the router routes to has taken it. An engine out of routing is
left to the router, which brings it to the fleet's version (restarting it if need be) before it takes
traffic again. A trainer that died mid-pause lifts nothing; the next one lifts the pause when it starts a
run, once the fleet has loaded the run's version (`trainer_core`).

The pause names SGLang's mode (its default, "abort", ends every generation in flight): "retract" holds them
(back in the queue; their KV cache may be dropped and is computed again once generation continues), "abort"
ends them for a run that resumes aborted completions itself (rollout.on_weight_update "abort_resume"). Never
"in_place": it keeps the KV cache, and SGLang's flush after the update then fails and takes the engine down.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Literal

import httpx

from rlfleet_trainer.router_client import RouterClient

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
"""Bound on one pause or continue call (the router fans it out to every engine at once)."""

PauseMode = Literal["retract", "abort"]
"""SGLang's `mode` of /pause_generation for generations in flight: held ("retract") or ended ("abort")."""


@contextlib.contextmanager
def generation_paused(router: RouterClient, mode: PauseMode) -> Iterator[None]:
    """Generation paused fleet-wide while the block runs; resumed after it, whatever happened in it.

    The pause is best effort: an engine that does not take it is one the router cannot reach, and so
    routes nothing to."""
    problem = _send(router, "/pause_generation", {"mode": mode})
    if problem is not None:
        logger.warning("/pause_generation did not reach every engine: %s", problem)
    try:
        yield
    finally:
        resume_generation(router)


def resume_generation(router: RouterClient) -> None:
    """Sends /continue_generation until every engine in routing took it, within `router.timeout_s`; never raises
    (the caller's own outcome matters more), but logs an error when engines may be left paused."""
    deadline = time.monotonic() + router.timeout_s
    delay = 0.5
    while True:
        problem = _continue_once(router)
        if problem is None:
            return
        if time.monotonic() + delay >= deadline:
            logger.error(
                "/continue_generation did not reach every engine in routing within %.0fs (%s); they stay paused "
                "until the router's pause bound has passed and it lifts the pause",
                router.timeout_s,
                problem,
            )
            return
        logger.warning("/continue_generation failed (%s); retrying in %.1fs", problem, delay)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def _continue_once(router: RouterClient) -> str | None:
    """None once no engine in routing is left paused; else what went wrong, for a retry."""
    problem = _send(router, "/continue_generation", {})
    if not isinstance(problem, set):
        return problem
    routed = _routed_engines(router)
    still_paused = problem & routed if routed is not None else problem
    if not still_paused:
        logger.info("/continue_generation did not reach %s, which are out of routing", sorted(problem))
        return None
    return f"engines in routing did not take it: {sorted(still_paused)}"


def _send(router: RouterClient, route: str, body: dict[str, object]) -> str | set[str] | None:
    """POSTs `body` to the router's `route`: None if every engine took it (or the router refused it, which a
    retry would not change); the URLs of the engines that did not take it (the fan-out's 502); or, as text, what
    failed before the router could fan it out."""
    try:
        response = httpx.post(router.base_url + route, json=body, headers=router.headers, timeout=CALL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code < 500:
        if response.status_code != 200:
            logger.warning("the router refused %s: HTTP %d %s", route, response.status_code, response.text[:300])
        return None
    try:
        engines = response.json()["engines"]
        return {str(e["url"]) for e in engines if not 200 <= (e["status"] or 0) < 300}
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:300]}"


def _routed_engines(router: RouterClient) -> set[str] | None:
    """URLs of the engines the router routes to, or None if it cannot say."""
    try:
        response = httpx.get(router.base_url + "/workers", headers=router.headers, timeout=CALL_TIMEOUT_S)
        workers = response.json()["workers"]
        return {str(w["url"]) for w in workers if w.get("state") == "healthy"}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        logger.warning("could not list the router's engines: %s", exc)
        return None
