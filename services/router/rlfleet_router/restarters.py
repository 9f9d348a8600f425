"""Restarters: how the router brings a failed engine back, chosen by name from a typed registry.

A restarter is any object with `restart(url) -> url`, `release(url)` and `close()` (the `Restarter`
protocol); `restart` returns once the engine was asked to come back, with the URL it serves on afterwards (a
Kubernetes pod comes back with a new address). The router's health checks decide when it is
healthy again, and it loads the fleet's weights before it rejoins routing. When an engine leaves the fleet its
restart, if one is under way, is cancelled, and `release` stops what the restarter started for it.

Built-ins, declared as entry points of this package in the group `rlfleet.router.restarters`:
`local` (engine processes from a command template), `docker` (Docker Engine API) and `kubernetes`
(delete the pod, wait for its replacement). Another installed package adds one by declaring an entry
point in that group whose target takes the `RouterConfig` and returns a restarter. Names are
resolved when the router starts, so a typo fails at once with the list of known names.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlfleet_router.config import RouterConfig

ENTRY_POINT_GROUP = "rlfleet.router.restarters"


class Restarter(Protocol):
    async def start(self) -> list[str]:
        """Engines this restarter launches when the router starts (their URLs); most launch none."""
        ...

    async def restart(self, url: str) -> str:
        """Restarts the engine serving at `url`; returns the URL it serves on now. Raises Unavailable."""
        ...

    async def release(self, url: str) -> None:
        """The engine at `url` left the fleet (a restart of it under way was cancelled first): stops what this
        restarter started for it, if anything. Not called if a worker at `url` joined again meanwhile."""
        ...

    async def close(self) -> None:
        """Releases what the restarter holds (clients, engine processes it started)."""
        ...


RestarterFactory = Callable[["RouterConfig"], Restarter]


def restarter_names() -> list[str]:
    """Names of the installed restarters (without importing them: `docker` needs its SDK only when chosen)."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def create_restarter(name: str, config: RouterConfig) -> Restarter:
    """The restarter called `name`; ValueError listing the known names otherwise."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise ValueError(f"unknown restarter {name!r}; known restarters: {', '.join(restarter_names())}")
    factory: RestarterFactory = found[0].load()
    return factory(config)
