"""The `docker` restarter: restarts an engine's container through the Docker Engine API (the `docker` SDK).

The container is named by `docker_container`, a template over the engine URL's `{host}` and `{port}`
(default `{host}`: in Compose, an engine's hostname is its service's container name or alias). A
restart is `POST /containers/{id}/restart?t=<stop timeout>`, then `GET /containers/{id}/json` until
the container runs again; the engine keeps its address. `docker_url` says where the API is
(`unix:///var/run/docker.sock` by default, or `tcp://host:2375`). The SDK is synchronous, so each
call runs in a worker thread, bounded by the SDK's own timeout and the restart timeout.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig


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

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        parts = urlsplit(url)
        name = self._container.format(host=parts.hostname or "", port=parts.port or "")
        try:
            await asyncio.to_thread(self._restart, name)
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
            self._client = self._docker.DockerClient(base_url=self._base_url, timeout=max(1, int(self._timeout)))
        container: Any = self._client.containers.get(name)
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


def create(config: RouterConfig) -> DockerRestarter:
    return DockerRestarter(
        base_url=config.docker_url,
        container=config.docker_container,
        stop_timeout_secs=config.docker_stop_timeout_secs,
        timeout_secs=config.restart_timeout_secs,
    )
