"""The `kubernetes` restarter: deletes a failed engine's pod and waits for its controller to replace it.

The pod is the one among `kubernetes_label_selector`'s pods whose IP is the engine URL's host. After
the delete, the restarter waits (bounded by the restart timeout) for a pod of the same selector
that did not exist before and is Ready, and returns its address on the same port: the engine
rejoins under its new IP, after loading the fleet's weights like any engine that joins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig
from rlfleet_router.kubernetes_api import KubernetesAPI, pod_ready

logger = logging.getLogger(__name__)


class KubernetesRestarter:
    def __init__(self, api: KubernetesAPI, label_selector: str, timeout_secs: float, poll_secs: float = 0.5) -> None:
        self._api = api
        self._selector = label_selector
        self._timeout = timeout_secs
        self._poll = poll_secs

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        parts = urlsplit(url)
        pods = await self._api.list_pods(self._selector)
        known = {p["metadata"]["uid"] for p in pods}
        failed = [p for p in pods if p.get("status", {}).get("podIP") == parts.hostname]
        if not failed:
            raise Unavailable(f"no pod matching {self._selector!r} in {self._api.namespace} has the IP of {url}")
        name = failed[0]["metadata"]["name"]
        logger.info("deleting pod %s of engine %s", name, url)
        await self._api.delete_pod(name)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(self._poll)
            for pod in await self._api.list_pods(self._selector):
                if pod["metadata"]["uid"] not in known and pod_ready(pod):
                    new_url = f"{parts.scheme}://{pod['status']['podIP']}:{parts.port}"
                    logger.info("pod %s replaced by %s at %s", name, pod["metadata"]["name"], new_url)
                    return new_url
        raise Unavailable(f"no replacement of pod {name} became Ready within {self._timeout:.0f}s")

    async def close(self) -> None:
        await self._api.close()


def create(config: RouterConfig) -> KubernetesRestarter:
    return KubernetesRestarter(
        KubernetesAPI.from_config(config), config.kubernetes_label_selector, config.restart_timeout_secs
    )
