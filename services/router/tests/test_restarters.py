"""The docker and kubernetes restarters and Kubernetes discovery, against fake API servers that follow the real APIs.

The Docker fake serves the Engine API paths the `docker` SDK calls (`/version`, `GET /containers/{id}/json`,
`POST /containers/{id}/restart?t=`); the Kubernetes fake serves core/v1 pods (list with labelSelector,
delete, a controller that replaces a deleted pod) and endpoints.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from router_fakes import ThreadedServer

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig
from rlfleet_router.docker_restarter import DockerRestarter
from rlfleet_router.kubernetes_api import KubernetesAPI
from rlfleet_router.kubernetes_discovery import KubernetesDiscovery
from rlfleet_router.kubernetes_restarter import KubernetesRestarter
from rlfleet_router.restarters import create_restarter, restarter_names
from rlfleet_router.workers import WorkerRegistry

SELECTOR = "app.kubernetes.io/component=engine"


@dataclass
class FakeDocker:
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    restarts: list[tuple[str, str | None]] = field(default_factory=list)

    def find(self, key: str) -> dict[str, Any] | None:
        """By name or id, as the Engine API resolves a container reference."""
        return self.containers.get(key) or next((c for c in self.containers.values() if c["Id"] == key), None)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/version")
        @app.get("/v{api}/version")
        async def version() -> dict[str, str]:
            return {"Version": "27.0.0", "ApiVersion": "1.46", "MinAPIVersion": "1.24", "Os": "linux"}

        @app.get("/v{api}/containers/{name}/json")
        async def inspect(api: str, name: str) -> JSONResponse:
            found = self.find(name)
            if found is None:
                return JSONResponse({"message": f"No such container: {name}"}, status_code=404)
            return JSONResponse(found)

        @app.post("/v{api}/containers/{name}/restart")
        async def restart(api: str, name: str, request: Request) -> Response:
            found = self.find(name)
            if found is None:
                return JSONResponse({"message": f"No such container: {name}"}, status_code=404)
            self.restarts.append((found["Name"].lstrip("/"), request.query_params.get("t")))
            found["State"] = {"Status": "running", "Running": True, "Restarting": False}
            return Response(status_code=204)

        return app


def container(name: str) -> dict[str, Any]:
    return {
        "Id": f"{name}-id",
        "Name": f"/{name}",
        "State": {"Status": "exited", "Running": False, "Restarting": False, "ExitCode": 137},
        "Config": {"Image": "rlfleet-engine", "Labels": {}},
    }


def test_docker_restarter_restarts_the_engines_container() -> None:
    docker = FakeDocker(containers={"engine-1": container("engine-1")})
    server = ThreadedServer(docker.app()).start()
    try:
        restarter = DockerRestarter(
            base_url=f"tcp://127.0.0.1:{server.port}", container="{host}", stop_timeout_secs=7, timeout_secs=10
        )
        assert asyncio.run(restarter.restart("http://engine-1:30000")) == "http://engine-1:30000"
        assert docker.restarts == [("engine-1", "7")]
        with pytest.raises(Unavailable, match="engine-2"):
            asyncio.run(restarter.restart("http://engine-2:30000"))
        asyncio.run(restarter.close())
    finally:
        server.stop()


@dataclass
class FakeKubernetes:
    """core/v1 pods and endpoints of one namespace, with a Deployment-like controller replacing deleted pods."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    ready_after_polls: int = 2
    _ips: itertools.count = field(default_factory=lambda: itertools.count(20))

    def add_pod(self, name: str, ip: str, ready: bool = True) -> None:
        self.pods[name] = {
            "metadata": {"name": name, "uid": f"uid-{name}", "labels": {"app.kubernetes.io/component": "engine"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }

    def _matching(self, selector: str | None) -> list[dict[str, Any]]:
        wanted = dict(part.split("=", 1) for part in selector.split(",")) if selector else {}
        return [p for p in self.pods.values() if all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())]

    def _controller_tick(self) -> None:
        for pod in self.pods.values():
            waits = pod.setdefault("_polls", 0)
            pod["_polls"] = waits + 1
            if waits + 1 >= self.ready_after_polls:
                pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def list_pods(ns: str, labelSelector: str | None = None) -> dict[str, Any]:  # noqa: N803 - the API's name
            self._controller_tick()
            items = [{k: v for k, v in p.items() if not k.startswith("_")} for p in self._matching(labelSelector)]
            return {"kind": "PodList", "apiVersion": "v1", "items": items}

        @app.delete("/api/v1/namespaces/{ns}/pods/{name}")
        async def delete_pod(ns: str, name: str) -> JSONResponse:
            if name not in self.pods:
                return JSONResponse({"kind": "Status", "reason": "NotFound", "code": 404}, status_code=404)
            self.deleted.append(name)
            del self.pods[name]
            replacement = f"engine-{next(self._ips)}"
            self.add_pod(replacement, f"10.0.0.{next(self._ips)}", ready=False)
            return JSONResponse({"kind": "Pod", "metadata": {"name": name}})

        @app.get("/api/v1/namespaces/{ns}/endpoints")
        async def list_endpoints(ns: str, labelSelector: str | None = None) -> dict[str, Any]:  # noqa: N803
            ready = [p for p in self.pods.values() if p["status"]["conditions"][0]["status"] == "True"]
            subset = {
                "addresses": [{"ip": p["status"]["podIP"]} for p in ready],
                "ports": [{"name": "http", "port": 30000, "protocol": "TCP"}],
            }
            item = {"metadata": {"name": "engines", "labels": {"app.kubernetes.io/component": "engine"}}}
            return {"kind": "EndpointsList", "items": [{**item, "subsets": [subset]}] if labelSelector else []}

        return app


def test_kubernetes_restarter_deletes_the_pod_and_returns_its_replacement() -> None:
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    server = ThreadedServer(kube.app()).start()
    try:

        async def scenario() -> str:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            restarter = KubernetesRestarter(api, SELECTOR, timeout_secs=10, poll_secs=0.05)
            try:
                return await restarter.restart("http://10.0.0.2:30000")
            finally:
                await restarter.close()

        new_url = asyncio.run(scenario())
        assert kube.deleted == ["engine-b"]
        replacement = next(p for n, p in kube.pods.items() if n not in ("engine-a",))
        assert new_url == f"http://{replacement['status']['podIP']}:30000"
    finally:
        server.stop()


def test_kubernetes_discovery_follows_the_ready_endpoints() -> None:
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    kube.add_pod("engine-c", "10.0.0.3", ready=False)
    server = ThreadedServer(kube.app()).start()
    workers = WorkerRegistry(failure_threshold=1, success_threshold=1)
    static, _ = workers.add("http://10.9.9.9:30000")
    try:

        async def scenario() -> None:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            discovery = KubernetesDiscovery(api, SELECTOR, None, 1.0, workers, workers.add, workers.remove)
            await discovery.sync()
            assert {w.url for w in workers.all()} == {static.url, "http://10.0.0.1:30000", "http://10.0.0.2:30000"}
            del kube.pods["engine-a"]
            await discovery.sync()
            assert {w.url for w in workers.all()} == {static.url, "http://10.0.0.2:30000"}, "static worker stays"
            await api.close()

        asyncio.run(scenario())
    finally:
        server.stop()


def test_restarters_are_chosen_by_name_and_validated() -> None:
    assert {"local", "docker", "kubernetes"} <= set(restarter_names())
    with pytest.raises(ValueError, match="known restarters: docker, kubernetes, local"):
        RouterConfig(restarter="systemd")
    with pytest.raises(ValueError, match="local_engine_command"):
        RouterConfig(restarter="local")
    config = RouterConfig(restarter="docker", docker_url="tcp://127.0.0.1:1")
    assert type(create_restarter("docker", config)).__name__ == "DockerRestarter"
