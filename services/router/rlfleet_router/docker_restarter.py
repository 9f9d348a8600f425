"""The `docker` restarter: restarts an engine's container through the Docker Engine API (the `docker` SDK).

The container is named by `docker_container`, a template over the engine URL's `{host}` and `{port}`
(default `{host}`). The Engine API resolves a container by id, id prefix or exact name, never by a host
name of a Compose network: Compose names an engine's container `<project>-<service>-<n>`
(`rlfleet-engine-0-1`) while other containers reach it as its service (`engine-0`) or a network alias (the
gpu profile's `engine-gpu-0` answers to `engine-0`). So a name no container has is looked up among all
containers, stopped ones included (`GET /containers/json?all=1`, each inspected, as the list leaves out network
aliases): the one whose `com.docker.compose.service` label or a network alias is that name. Several such
containers (stale ones of another profile or project, a scaled service) are refused by name rather than
restarting a wrong one: `docker_container` then names the container.

A restart is `POST /containers/{id}/restart?t=<stop timeout>`, then `GET /containers/{id}/json` until the
container runs again; the engine keeps its address. `docker_url` says where the API is
(`unix:///var/run/docker.sock` by default, or `tcp://host:2375`). The SDK is synchronous, so each call runs in a
worker thread, bounded by the SDK's own timeout and the restart timeout.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig

COMPOSE_SERVICE_LABEL = "com.docker.compose.service"


def answers_to(attrs: dict[str, Any], host: str) -> bool:
    """Whether a container (its `GET /containers/{id}/json` attributes) is reached as `host` on a Compose
    network: it runs that Compose service, or has that network alias on one of its networks."""
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
    return labels.get(COMPOSE_SERVICE_LABEL) == host or any(
        host in ((endpoint or {}).get("Aliases") or []) for endpoint in networks.values()
    )


class DockerRestarter:
    def __init__(self, base_url: str, container: str, stop_timeout_secs: int, timeout_secs: float) -> None:
        import docker  # the SDK is needed only when this restarter is chosen

        self._docker = docker
        self._base_url = base_url
        # Made at the first restart: the router starts (and routes) even while the Docker API is unreachable.
        self._client: Any = None
        self._container = container
        self._stop_timeout = stop_timeout_secs
        self._timeout = timeout_secs
        # The SDK's blocking calls run in threads that outlive an attempt the healer gave up on: the next attempt
        # at a container waits for the one still under way rather than send the daemon another restart.
        self._under_way: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        parts = urlsplit(url)
        name = self._container.format(host=parts.hostname or "", port=parts.port or "")
        pending = self._under_way.get(name)
        if pending is None or pending.done():
            pending = self._under_way[name] = asyncio.ensure_future(asyncio.to_thread(self._restart, name))
        try:
            await asyncio.shield(pending)
        except self._docker.errors.DockerException as exc:
            raise Unavailable(f"docker could not restart container {name!r} of {url}: {exc}") from exc
        return url

    async def release(self, url: str) -> None:
        pass  # the container is the operator's: a restart leaves it as it was, running

    async def close(self) -> None:
        if self._client is not None:
            await asyncio.to_thread(self._client.close)

    def _restart(self, name: str) -> None:
        if self._client is None:
            # A restart's HTTP call may take the client's timeout plus the stop timeout (docker-py adds it).
            timeout = max(1, int(self._timeout) - self._stop_timeout)
            self._client = self._docker.DockerClient(base_url=self._base_url, timeout=timeout)
        container = self._find(name)
        container.restart(timeout=self._stop_timeout)
        deadline = time.monotonic() + self._timeout
        while True:
            container.reload()
            state = container.attrs.get("State", {})
            if state.get("Running") and not state.get("Restarting"):
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"container {name!r} not running {self._timeout:.0f}s after its restart: {state}")
            time.sleep(0.2)

    def _find(self, name: str) -> Any:
        """The container called `name`, else the one container a Compose network knows by that host name."""
        try:
            return self._client.containers.get(name)
        except self._docker.errors.NotFound:
            pass
        # Not sparse: the list's summaries carry no network aliases, so the SDK inspects each container.
        found = [c for c in self._client.containers.list(all=True, ignore_removed=True) if answers_to(c.attrs, name)]
        if len(found) == 1:
            return found[0]
        fix = "set --docker-container (RLFLEET_ROUTER_DOCKER_CONTAINER), a template over {host} and {port}"
        if not found:
            raise Unavailable(
                f"no container is named {name!r}, runs Compose service {name!r} or has network alias {name!r}: "
                f"{fix}, to the engine's container name"
            )
        raise Unavailable(
            f"containers {', '.join(sorted(c.name for c in found))} all answer to {name!r} (a Compose service or "
            f"network alias): remove the stale ones (`docker rm`) or {fix}, to the name "
            "of the one to restart"
        )


def create(config: RouterConfig) -> DockerRestarter:
    return DockerRestarter(
        base_url=config.docker_url,
        container=config.docker_container,
        stop_timeout_secs=config.docker_stop_timeout_secs,
        timeout_secs=config.restart_timeout_secs,
    )
