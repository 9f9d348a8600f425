"""The `kubernetes` restarter: deletes a failed engine's pod and waits for its controller to replace it.

The pod is the one among `kubernetes_label_selector`'s pods that the engine URL's host names: by its
IP, or by its name as the first label of its DNS name (a StatefulSet pod behind a headless Service is
`<pod>.<service>.<namespace>.svc`, the form the Helm chart lists and discovery finds). After the
delete (of that pod only: a precondition on its uid), the restarter waits (bounded by the restart timeout)
for a pod of the same selector that did
not exist before and is Ready: under the same name when the URL names the pod, which then keeps its
URL; any new pod when the URL is an IP, whose address on the same port it returns. A new pod one restart
took is not taken by another (two engines restarted at once get one pod each). Discovery may have made
the replacement a worker of its own already: the healer then drops the restarted worker rather than have
two workers at one URL (`WorkerRegistry.move`). Either way the engine rejoins after loading the fleet's
weights like any engine that joins. A pod being deleted already, or created within the restart timeout and
not Ready yet (its controller's replacement of a pod someone else deleted, still loading the model), is not
deleted: the restarter waits for it, or its replacement.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig
from rlfleet_router.kubernetes_api import KubernetesAPI, pod_ready, url_host

logger = logging.getLogger(__name__)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _age_secs(meta: dict[str, Any]) -> float:
    """Seconds since the pod was created; infinite when its metadata does not say."""
    try:
        created = datetime.fromisoformat(str(meta["creationTimestamp"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return math.inf
    return (datetime.now(UTC) - created).total_seconds()


class KubernetesRestarter:
    def __init__(self, api: KubernetesAPI, label_selector: str, timeout_secs: float, poll_secs: float = 0.5) -> None:
        self._api = api
        self._selector = label_selector
        self._timeout = timeout_secs
        self._poll = poll_secs
        # Uids of the new pods restarts took as replacements, while those pods exist: no other restart takes them.
        self._claimed: set[str] = set()

    async def start(self) -> list[str]:
        return []

    async def restart(self, url: str) -> str:
        parts = urlsplit(url)
        host = parts.hostname or ""
        by_ip = _is_ip(host)
        pod_name = None if by_ip else host.split(".", 1)[0]

        def serves(pod: dict[str, Any]) -> bool:
            if by_ip:
                return bool(pod.get("status", {}).get("podIP") == host)
            return bool(pod["metadata"]["name"] == pod_name)

        pods = await self._api.list_pods(self._selector)
        known = {p["metadata"]["uid"] for p in pods}
        failed = [p for p in pods if serves(p)]
        if not failed:
            what = "has the IP of" if by_ip else f"is named {pod_name!r} as the host of"
            raise Unavailable(f"no pod matching {self._selector!r} in {self._api.namespace} {what} {url}")
        meta = failed[0]["metadata"]
        name = meta["name"]
        if meta.get("deletionTimestamp"):
            logger.info("pod %s of engine %s is being deleted already: waiting for its replacement", name, url)
        elif not pod_ready(failed[0]) and _age_secs(meta) < self._timeout:
            # Its controller's replacement of a pod deleted, evicted or drained, still loading the model: deleted,
            # it would start over.
            logger.info(
                "pod %s of engine %s is new and not Ready yet: waiting for it rather than deleting it", name, url
            )
            known.discard(meta["uid"])
        else:
            logger.info("deleting pod %s of engine %s", name, url)
            await self._api.delete_pod(name, meta["uid"])
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(self._poll)
            pods = await self._api.list_pods(self._selector)
            self._claimed &= {p["metadata"]["uid"] for p in pods}
            for pod in pods:
                uid = pod["metadata"]["uid"]
                if uid in known or uid in self._claimed or not pod_ready(pod) or not (by_ip or serves(pod)):
                    continue
                self._claimed.add(uid)
                port = "" if parts.port is None else f":{parts.port}"  # None: the scheme's default, left out
                new_url = f"{parts.scheme}://{url_host(pod['status']['podIP'])}{port}" if by_ip else url
                logger.info("pod %s replaced by %s at %s", name, pod["metadata"]["name"], new_url)
                return new_url
        raise Unavailable(f"no replacement of pod {name} became Ready within {self._timeout:.0f}s")

    async def release(self, url: str) -> None:
        pass  # the pod is its controller's: nothing was started here

    async def close(self) -> None:
        await self._api.close()


def create(config: RouterConfig) -> KubernetesRestarter:
    return KubernetesRestarter(
        KubernetesAPI.from_config(config), config.kubernetes_label_selector, config.restart_timeout_secs
    )
