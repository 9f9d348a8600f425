"""Engines found from Kubernetes Endpoints by label: the fleet follows the ready addresses of the engine Service.

Every `kubernetes_discovery_interval_secs`, the Endpoints objects matching `kubernetes_label_selector`
(the endpoints controller copies a Service's labels onto its Endpoints) give the ready addresses;
each address on the engine port is a worker URL. The port is `kubernetes_engine_port`, else the
Endpoints' only port: Kubernetes lists a subset's ports in no set order, so of several ports none is
taken (a metrics port would be as likely as the engine's), and the router says so once. A pod
of a StatefulSet behind a headless Service has a stable DNS name, `<hostname>.<service>.<namespace>.svc`,
which its address carries as `hostname`: the URL uses that name, so an engine keeps its URL (and its
place in the fleet) when its pod is recreated, and is the same worker as one listed under that name in
`worker_urls`. Other addresses are URLs by IP.
New URLs join the fleet (pending until healthy and on the fleet's weights); URLs this discovery
added that are gone leave it, unless the engine is being restarted (its pod recreated), for up to
`gone_after_secs` (the restart timeout): one whose pod is gone for good (the StatefulSet scaled down) would
otherwise be restarted for ever. Engines given any other way (`worker_urls`, `POST /workers`) are never
removed by discovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rlfleet.errors import InvalidInput, Unavailable
from rlfleet_router.kubernetes_api import KubernetesAPI, url_host
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)


def endpoint_urls(
    endpoints: list[dict[str, Any]], port: int | None, namespace: str
) -> tuple[set[str], dict[str, list[int]]]:
    """The worker URLs of the Endpoints' ready addresses, and the Endpoints (by name) whose addresses were left
    out because they list several ports and `port` is not set (with those ports)."""
    urls: set[str] = set()
    ambiguous: dict[str, list[int]] = {}
    for item in endpoints:
        service = item.get("metadata", {}).get("name")
        for subset in item.get("subsets") or []:
            ports = sorted({p.get("port") for p in subset.get("ports") or [] if isinstance(p.get("port"), int)})
            chosen = port if port is not None else (ports[0] if len(ports) == 1 else None)
            if chosen is None:
                if ports:
                    ambiguous[service or "?"] = ports
                continue
            for address in subset.get("addresses") or []:  # ready addresses only; notReadyAddresses are not
                if address.get("hostname") and service:
                    urls.add(f"http://{address['hostname']}.{service}.{namespace}.svc:{chosen}")
                elif address.get("ip"):
                    urls.add(f"http://{url_host(address['ip'])}:{chosen}")
    return urls, ambiguous


class KubernetesDiscovery:
    def __init__(
        self,
        api: KubernetesAPI,
        label_selector: str,
        port: int | None,
        interval_secs: float,
        workers: WorkerRegistry,
        add: Callable[[str], tuple[Worker, bool]],
        remove: Callable[[str], Worker],
        gone_after_secs: float,
    ) -> None:
        self._api = api
        self._selector = label_selector
        self._port = port
        self._interval = interval_secs
        self._workers = workers
        self._add = add
        self._remove = remove
        self._found: set[str] = set()  # ids of the workers discovery added
        self._gone_after = gone_after_secs
        self._missing_since: dict[str, float] = {}  # ids of restarting workers whose address is gone -> since when
        self._warned: dict[str, list[int]] = {}  # Endpoints left out for their several ports, said once each
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubernetes-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5)
        await self._api.close()

    async def sync(self) -> None:
        """One round: add new addresses, remove the discovered workers whose address is gone."""
        urls, ambiguous = endpoint_urls(await self._api.list_endpoints(self._selector), self._port, self._api.namespace)
        for name, ports in ambiguous.items():
            if self._warned.get(name) != ports:
                logger.warning(
                    "Endpoints %s list ports %s and --kubernetes-engine-port is not set: its addresses are not engines "
                    "until it names the engine's port",
                    name,
                    ports,
                )
        self._warned = ambiguous
        present: set[str] = set()  # as the fleet spells them (`http://10.0.0.1:80` is `http://10.0.0.1`)
        for url in sorted(urls):
            try:
                worker, created = self._add(url)
            except InvalidInput as exc:  # one address the fleet refuses must not keep the others out
                logger.warning("discovered address %s not added: %s", url, exc)
                continue
            present.add(worker.url)
            if created:
                logger.info("discovered engine %s", url)
                self._found.add(worker.id)
        now = time.monotonic()
        for worker in self._workers.all():
            if worker.id not in self._found:
                continue
            if worker.url in present or not worker.restarting:
                self._missing_since.pop(worker.id, None)
                if worker.url in present:
                    continue
                logger.info("engine %s left the Endpoints; removing it", worker.url)
            else:
                missing = now - self._missing_since.setdefault(worker.id, now)
                if missing < self._gone_after:
                    continue  # its pod is being recreated
                del self._missing_since[worker.id]
                logger.warning(
                    "engine %s left the Endpoints %.0fs ago and its restart has not brought it back; removing it",
                    worker.url,
                    missing,
                )
            self._found.discard(worker.id)
            self._remove(worker.id)

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
            except Unavailable as exc:
                logger.warning("engine discovery failed; keeping the current fleet: %s", exc)
            except Exception:  # one bad round (an address the fleet refuses) must not end discovery for good
                logger.exception("engine discovery round failed; keeping the current fleet")
            await asyncio.sleep(self._interval)
