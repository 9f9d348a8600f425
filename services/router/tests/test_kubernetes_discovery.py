"""Kubernetes discovery: the fleet follows the ready endpoints of the engine Service's EndpointSlices, against the
fake API server of `kubernetes_fakes.py` (slices as the EndpointSlice controller writes them) and on slices given
whole where the controller's variants are the point (dual-stack, open ports, conditions left out)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from kubernetes_fakes import FakeKubernetes
from router_fakes import ThreadedServer

from rlfleet.errors import Unavailable
from rlfleet_router.kubernetes_api import KubernetesAPI
from rlfleet_router.kubernetes_discovery import KubernetesDiscovery, endpoint_slice_urls
from rlfleet_router.workers import WorkerRegistry

SELECTOR = "app.kubernetes.io/component=engine"
HTTP = [{"name": "http", "port": 30000, "protocol": "TCP"}]


@contextmanager
def served(kube: FakeKubernetes) -> Iterator[str]:
    server = ThreadedServer(kube.app()).start()
    try:
        yield server.url
    finally:
        server.stop()


def discovery(
    url: str, workers: WorkerRegistry, port: int | None = None, gone_after_secs: float = 60.0
) -> KubernetesDiscovery:
    api = KubernetesAPI(url, "rl", None, None, timeout_secs=5)
    return KubernetesDiscovery(api, SELECTOR, port, 1.0, workers, workers.add, workers.remove, gone_after_secs)


def endpoint_slice(
    addresses: list[list[str]],
    family: str = "IPv4",
    ports: list[dict[str, Any]] | None = HTTP,
    service: str = "engines",
    **endpoint: Any,
) -> dict[str, Any]:
    """A slice of `service` with one ready endpoint per address list (extra keys go into every endpoint)."""
    return {
        "metadata": {"name": f"{service}-{family.lower()}", "labels": {"kubernetes.io/service-name": service}},
        "addressType": family,
        "endpoints": [{"addresses": a, "conditions": {"ready": True}, **endpoint} for a in addresses],
        "ports": ports,
    }


def test_kubernetes_discovery_follows_the_ready_endpoints() -> None:
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    kube.add_pod("engine-c", "10.0.0.3", ready=False)  # listed in the slice, not ready
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    static, _ = workers.add("http://10.9.9.9:30000")
    with served(kube) as url:

        async def scenario() -> None:
            found = discovery(url, workers)
            await found.sync()
            assert {w.url for w in workers.all()} == {static.url, "http://10.0.0.1:30000", "http://10.0.0.2:30000"}
            del kube.pods["engine-a"]
            await found.sync()
            assert {w.url for w in workers.all()} == {static.url, "http://10.0.0.2:30000"}, "static worker stays"
            await found.stop()

        asyncio.run(scenario())


def test_kubernetes_discovery_joins_the_slices_of_a_service() -> None:
    """A Service has a slice per 100 endpoints: every slice's engines join, and one leaving any slice leaves."""
    kube = FakeKubernetes(max_endpoints_per_slice=2)
    for i in range(1, 6):
        kube.add_pod(f"engine-{i}", f"10.0.0.{i}", ready=i != 4)
    assert len(kube.endpoint_slices()) == 3
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    with served(kube) as url:

        async def scenario() -> None:
            found = discovery(url, workers)
            await found.sync()
            assert sorted(w.url for w in workers.all()) == [f"http://10.0.0.{i}:30000" for i in (1, 2, 3, 5)]
            del kube.pods["engine-3"]
            await found.sync()
            assert sorted(w.url for w in workers.all()) == [f"http://10.0.0.{i}:30000" for i in (1, 2, 5)]
            await found.stop()

        asyncio.run(scenario())


def test_a_dual_stack_pod_is_one_engine() -> None:
    """A dual-stack Service slices each pod once per address family: one family is taken, IPv4 where the Service
    has it, so a pod is not two engines."""
    kube = FakeKubernetes(dual_stack=True)
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    assert sorted(s["addressType"] for s in kube.endpoint_slices()) == ["IPv4", "IPv6"]
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    with served(kube) as url:

        async def scenario() -> None:
            found = discovery(url, workers)
            await found.sync()
            await found.stop()

        asyncio.run(scenario())
    assert sorted(w.url for w in workers.all()) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]


def test_kubernetes_discovery_takes_ipv6_addresses_in_brackets() -> None:
    """An IPv6 endpoint is a URL host in brackets; before, it made an invalid URL that ended discovery. The family
    is chosen per Service: an IPv6-only Service beside a dual-stack one keeps its engines."""
    slices = [
        endpoint_slice([["fd00::7"]], "IPv6", service="v6-engines"),
        endpoint_slice([["10.0.0.5"]], "IPv4"),
        endpoint_slice([["fd00::5"]], "IPv6"),
    ]
    urls = {"http://10.0.0.5:30000", "http://[fd00::7]:30000"}
    assert endpoint_slice_urls(slices, None, "rl") == (urls, {})
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    for url in urls:
        workers.add(url)
    assert len(workers.all()) == 2


def test_an_endpoint_is_ready_unless_its_conditions_say_it_is_not() -> None:
    """`conditions.ready` missing or null reads as ready (the API's rule); ready false is left out even while it
    serves (terminating). An endpoint's addresses are all one endpoint's; FQDN slices give no engine."""
    item = endpoint_slice([])
    item["endpoints"] = [
        {"addresses": ["10.0.0.1"]},
        {"addresses": ["10.0.0.2"], "conditions": None},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": None}},
        {"addresses": ["10.0.0.4", "10.0.0.44"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.5"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": [], "conditions": {"ready": True}},
    ]
    fqdn = endpoint_slice([["engine.example.com"]], "FQDN", service="external")
    placeholder = {**endpoint_slice([], service="idle"), "endpoints": None}  # a Service without pods
    urls, left_out = endpoint_slice_urls([item, fqdn, placeholder], None, "rl")
    assert urls == {f"http://10.0.0.{i}:30000" for i in (1, 2, 3, 4)} and left_out == {}


def test_kubernetes_discovery_names_statefulset_engines_as_the_chart_lists_them() -> None:
    """A StatefulSet pod's endpoint carries its hostname: discovery's URL is the pod's DNS name through the
    headless Service (named by the slice's `kubernetes.io/service-name`, not the slice's own name), so an engine
    also given in worker_urls under that name is one worker, not two; in both families of a dual-stack Service."""
    kube = FakeKubernetes(stateful=True, dual_stack=True)
    kube.add_pod("rl-engine-0", "10.0.0.1")
    kube.add_pod("rl-engine-1", "10.0.0.2")
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    listed, _ = workers.add("http://rl-engine-0.engines.rl.svc:30000")
    with served(kube) as url:

        async def scenario() -> None:
            found = discovery(url, workers)
            await found.sync()
            await found.stop()

        asyncio.run(scenario())
    assert sorted(w.url for w in workers.all()) == [listed.url, "http://rl-engine-1.engines.rl.svc:30000"]


def test_kubernetes_discovery_keeps_engines_on_the_default_port() -> None:
    """The fleet spells `http://10.0.0.1:80` as `http://10.0.0.1`; before, discovery compared the slices' spelling
    with the fleet's and removed every engine on port 80 in the round that added it, every round."""
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    with served(kube) as url:

        async def scenario() -> list[list[str]]:
            found = discovery(url, workers, port=80)
            rounds = []
            for _ in range(2):
                await found.sync()
                rounds.append([w.id for w in workers.all()])
            await found.stop()
            return rounds

        first, second = asyncio.run(scenario())
    assert len(first) == 1 and second == first
    assert [w.url for w in workers.all()] == ["http://10.0.0.1"]


def test_kubernetes_discovery_removes_a_restarting_engine_whose_address_stays_gone() -> None:
    """A pod being recreated leaves the slices for a while, and its engine, being restarted, stays; one gone for
    good (its StatefulSet scaled down) stays only until the restart timeout: before, it was restarted for ever."""
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    with served(kube) as url:

        async def scenario() -> None:
            found = discovery(url, workers, gone_after_secs=0.3)
            await found.sync()
            gone = workers.get("http://10.0.0.2:30000")
            gone.restarting = True
            del kube.pods["engine-b"]
            await found.sync()
            assert workers.contains(gone), "kept while its pod may be recreated"
            await asyncio.sleep(0.3)
            await found.sync()
            assert [w.url for w in workers.all()] == ["http://10.0.0.1:30000"]
            await found.stop()

        asyncio.run(scenario())


class Listed:
    """An API that lists the given slices, each time with their ports in another order (Kubernetes sets none)."""

    namespace = "rl"

    def __init__(self, slices: list[dict[str, Any]]) -> None:
        self.slices = slices

    async def list_endpoint_slices(self, selector: str) -> list[dict[str, Any]]:
        for item in self.slices:
            item["ports"] = item["ports"][::-1] if item["ports"] else item["ports"]
        return self.slices


def test_kubernetes_discovery_takes_no_port_of_several_without_the_engine_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kubernetes lists a slice's ports in no set order: the first of several was the metrics port as often as
    the engine's. Without --kubernetes-engine-port such a Service gives no engine, and says why once."""
    ports = [{"name": "metrics", "port": 9100}, {"name": "http", "port": 30000}]
    slices = [endpoint_slice([["10.0.0.5"]], ports=ports), endpoint_slice([["10.0.0.6"]], ports=ports[::-1])]
    assert endpoint_slice_urls(slices, None, "rl") == (set(), {"engines": [9100, 30000]})
    assert endpoint_slice_urls(slices, 30000, "rl") == ({"http://10.0.0.5:30000", "http://10.0.0.6:30000"}, {})

    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    found = KubernetesDiscovery(Listed(slices), SELECTOR, None, 1.0, workers, workers.add, workers.remove, 60.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="rlfleet_router.kubernetes_discovery"):
        for _ in range(3):
            asyncio.run(found.sync())
    assert workers.all() == []
    said = [r.getMessage() for r in caplog.records]
    assert (
        len(said) == 1 and "EndpointSlices of engines list ports [9100, 30000] and --kubernetes-engine-port" in said[0]
    )


@pytest.mark.parametrize("port", [None, 30000])
def test_a_slice_that_leaves_its_ports_open_needs_the_engine_port(
    port: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A slice without ports (or with a port without a number) stands for every port: only
    --kubernetes-engine-port can name the engine's."""
    kube = FakeKubernetes(ports=None)
    kube.add_pod("engine-a", "10.0.0.1")
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    with served(kube) as url, caplog.at_level(logging.WARNING, logger="rlfleet_router.kubernetes_discovery"):

        async def scenario() -> None:
            found = discovery(url, workers, port=port)
            for _ in range(2):
                await found.sync()
            await found.stop()

        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    if port is None:
        assert workers.all() == []
        assert len(said) == 1 and "EndpointSlices of engines leave a port open" in said[0]
    else:
        assert [w.url for w in workers.all()] == ["http://10.0.0.1:30000"] and said == []
    unnumbered = endpoint_slice([["10.0.0.1"]], ports=[*HTTP, {"name": "all", "protocol": "TCP"}])
    assert endpoint_slice_urls([unnumbered], None, "rl") == (set(), {"engines": [30000]})


def test_a_discovery_round_is_bounded_by_the_api_timeout() -> None:
    """An API server that takes the connection and never answers fails the round within the timeout; the fleet
    is kept as it is."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts connections; nothing ever answers
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    try:

        async def scenario() -> float:
            api = KubernetesAPI(f"http://127.0.0.1:{silent.getsockname()[1]}", "rl", None, None, timeout_secs=0.2)
            found = KubernetesDiscovery(api, SELECTOR, None, 1.0, workers, workers.add, workers.remove, 60.0)
            started = time.monotonic()
            try:
                with pytest.raises(Unavailable, match="endpointslices.*ReadTimeout"):
                    await asyncio.wait_for(found.sync(), 5)
                return time.monotonic() - started
            finally:
                await found.stop()

        assert asyncio.run(scenario()) < 2
    finally:
        silent.close()


def test_an_api_answer_that_is_not_json_fails_the_round_as_unavailable_in_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A proxy in front of the API server can answer 200 with its own HTML page. That used to raise a JSONDecodeError
    out of the API client, logged by the discovery loop with a traceback as if the router itself were broken."""
    app = FastAPI()

    @app.get("/apis/discovery.k8s.io/v1/namespaces/rl/endpointslices")
    async def proxy_page() -> HTMLResponse:
        return HTMLResponse("<html>\n<body>Sign in to the cluster proxy</body>\n</html>")

    server = ThreadedServer(app).start()
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)

    async def scenario() -> None:
        found = discovery(server.url, workers)
        with pytest.raises(Unavailable) as raised:
            await found.sync()
        said = str(raised.value)
        assert f"{server.url}/apis/discovery.k8s.io/v1/namespaces/rl/endpointslices" in said, said
        assert "HTTP 200 but not JSON" in said and "<body>Sign in to the cluster proxy</body>" in said, said
        found.start()
        async with asyncio.timeout(5):
            while not caplog.records:
                await asyncio.sleep(0.02)
        await found.stop()

    try:
        with caplog.at_level(logging.WARNING, logger="rlfleet_router.kubernetes_discovery"):
            asyncio.run(scenario())
    finally:
        server.stop()
    [record] = caplog.records
    assert not record.exc_info and "\n" not in record.getMessage(), record.getMessage()
    assert "engine discovery failed; keeping the current fleet" in record.getMessage()
