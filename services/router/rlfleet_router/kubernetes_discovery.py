"""Engines found from Kubernetes EndpointSlices by label: the fleet follows the ready endpoints of the engine Service.

Every `kubernetes_discovery_interval_secs`, the discovery.k8s.io/v1 EndpointSlices matching
`kubernetes_label_selector` (their controller copies a Service's labels onto them, and names the Service in
`kubernetes.io/service-name`) give the ready endpoints; each endpoint on the engine port is a worker URL. A
Service has several slices (one per 100 endpoints, one per address family when dual-stack): they are joined,
and of a dual-stack Service one family is taken, IPv4 if it has an IPv4 slice, so that a pod is one engine,
not one per address; FQDN slices are not engines. The port is `kubernetes_engine_port`, else the slice's only
port: Kubernetes lists a slice's ports in no set order, so of several ports none is taken (a metrics port
would be as likely as the engine's), nor any of a slice whose ports are left open (no port named: every
port), and the router says so once. A pod of a StatefulSet behind a headless Service has a stable DNS name,
`<hostname>.<service>.<namespace>.svc`, which its endpoint carries as `hostname`: the URL uses that name, so
an engine keeps its URL (and its place in the fleet) when its pod is recreated, and is the same worker as one
listed under that name in `worker_urls`. Other endpoints are URLs by their (first) address.
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


SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def endpoint_slice_urls(
    slices: list[dict[str, Any]], port: int | None, namespace: str
) -> tuple[set[str], dict[str, list[int]]]:
    """The worker URLs of the EndpointSlices' ready endpoints, and the Services (by name) whose endpoints were left
    out because `port` is not set and a slice of theirs names several ports or leaves one open (with the ports
    it names)."""
    services: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for item in slices:
        metadata = item.get("metadata") or {}
        service = (metadata.get("labels") or {}).get(SERVICE_NAME_LABEL)
        services.setdefault((service or metadata.get("name") or "?", service), []).append(item)
    urls: set[str] = set()
    left_out: dict[str, list[int]] = {}
    for (name, service), service_slices in services.items():
        family = "IPv4" if any(item.get("addressType") == "IPv4" for item in service_slices) else "IPv6"
        for item in service_slices:
            if item.get("addressType") != family:
                continue  # FQDN slices, and the other family of a dual-stack Service: one pod, one engine
            ports, only = _slice_ports(item)
            chosen = port if port is not None else only
            if chosen is None:
                left_out[name] = sorted({*left_out.get(name, []), *ports})
                continue
            for endpoint in item.get("endpoints") or []:
                if (endpoint.get("conditions") or {}).get("ready") is False:  # a missing or null `ready` is ready
                    continue
                addresses = endpoint.get("addresses") or []  # all of one endpoint
                if endpoint.get("hostname") and service:
                    urls.add(f"http://{endpoint['hostname']}.{service}.{namespace}.svc:{chosen}")
                elif addresses:
                    urls.add(f"http://{url_host(addresses[0])}:{chosen}")
    return urls, left_out


def _slice_ports(item: dict[str, Any]) -> tuple[list[int], int | None]:
    """The port numbers a slice names, and its one port if it names exactly one and leaves none open (a port
    without a number, or no `ports` at all, stands for every port)."""
    entries = item.get("ports") or []
    ports = sorted({entry.get("port") for entry in entries if isinstance(entry.get("port"), int)})
    named = len(ports) == 1 and all(isinstance(entry.get("port"), int) for entry in entries)
    return ports, ports[0] if named else None


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
        self._warned: dict[str, list[int]] = {}  # Services left out for their ports, said once each
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
        slices = await self._api.list_endpoint_slices(self._selector)
        urls, left_out = endpoint_slice_urls(slices, self._port, self._api.namespace)
        for name, ports in left_out.items():
            if self._warned.get(name) != ports:
                logger.warning(
                    "EndpointSlices of %s %s and --kubernetes-engine-port is not set: their endpoints are not "
                    "engines until it names the engine's port",
                    name,
                    f"list ports {ports}" if len(ports) > 1 else "leave a port open (no number: every port)",
                )
        self._warned = left_out
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
                logger.info("engine %s left the EndpointSlices; removing it", worker.url)
            else:
                missing = now - self._missing_since.setdefault(worker.id, now)
                if missing < self._gone_after:
                    continue  # its pod is being recreated
                del self._missing_since[worker.id]
                logger.warning(
                    "engine %s left the EndpointSlices %.0fs ago and its restart has not brought it back; removing it",
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
