"""The restarters; docker and kubernetes against fake API servers that follow the real APIs.

The Docker fake serves the Engine API paths the `docker` SDK calls (`/version`, `GET /containers/{id}/json`,
`GET /containers/json` with `all` and `filters`, `POST /containers/{id}/restart?t=`); the Kubernetes fake
(`kubernetes_fakes.py`) serves core/v1 pods, with a controller that replaces a deleted pod as a Deployment or as
a StatefulSet does. Discovery is tested in `test_kubernetes_discovery.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from kubernetes_fakes import FakeKubernetes
from router_fakes import ThreadedServer

from rlfleet.errors import Unavailable
from rlfleet.processes import process_runs
from rlfleet_router.config import RouterConfig
from rlfleet_router.docker_restarter import DockerRestarter, answers_to
from rlfleet_router.kubernetes_api import KubernetesAPI
from rlfleet_router.kubernetes_restarter import KubernetesRestarter
from rlfleet_router.local_restarter import LocalRestarter
from rlfleet_router.metrics import RouterMetrics
from rlfleet_router.policies import LeastLoad
from rlfleet_router.restarters import create_restarter, restarter_names
from rlfleet_router.self_healing import Healer
from rlfleet_router.workers import WorkerRegistry

SELECTOR = "app.kubernetes.io/component=engine"


@dataclass
class FakeDocker:
    """The Docker Engine API paths the `docker` SDK calls, as the daemon answers them.

    `GET /containers/{ref}/json` resolves a full id, an exact name or a unique id prefix, never a network alias
    or a Compose service; `GET /containers/json` lists running containers (all of them with `all=1`) as summaries
    that, as the daemon's, carry each network's addresses but not its aliases, filtered by `filters` (JSON
    map of lists; label `key` or `key=value`, name and id as regular expressions, status).
    """

    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    restarts: list[tuple[str, str | None]] = field(default_factory=list)

    def add(self, *attrs: dict[str, Any]) -> FakeDocker:
        for one in attrs:
            self.containers[one["Name"].lstrip("/")] = one
        return self

    def find(self, ref: str) -> dict[str, Any] | None:
        """As the daemon resolves a reference: a full id, an exact name, else a unique id prefix."""
        by_id = {c["Id"]: c for c in self.containers.values()}
        if ref in by_id or ref in self.containers:
            return by_id.get(ref) or self.containers[ref]
        by_prefix = [c for id_, c in by_id.items() if id_.startswith(ref)]
        return by_prefix[0] if len(by_prefix) == 1 else None

    def summary(self, attrs: dict[str, Any]) -> dict[str, Any]:
        networks = {
            name: {k: v for k, v in endpoint.items() if k not in ("Aliases", "DNSNames")}
            for name, endpoint in attrs["NetworkSettings"]["Networks"].items()
        }
        return {
            "Id": attrs["Id"],
            "Names": [attrs["Name"]],
            "Image": attrs["Config"]["Image"],
            "Labels": attrs["Config"]["Labels"],
            "State": attrs["State"]["Status"],
            "Status": attrs["State"]["Status"],
            "NetworkSettings": {"Networks": networks},
        }

    @staticmethod
    def matches(attrs: dict[str, Any], filters: dict[str, list[str]]) -> bool:
        labels = attrs["Config"]["Labels"]
        for kind, wanted in filters.items():
            if kind == "label":
                ok = all(
                    labels.get(key) == value if sep else key in labels
                    for key, sep, value in (w.partition("=") for w in wanted)
                )
            elif kind == "name":
                ok = any(re.search(w, attrs["Name"]) for w in wanted)
            elif kind == "id":
                ok = any(re.search(w, attrs["Id"]) for w in wanted)
            elif kind == "status":
                ok = attrs["State"]["Status"] in wanted
            else:
                raise ValueError(kind)
            if not ok:
                return False
        return True

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/version")
        @app.get("/v{api}/version")
        async def version() -> dict[str, str]:
            return {"Version": "27.0.0", "ApiVersion": "1.46", "MinAPIVersion": "1.24", "Os": "linux"}

        @app.get("/v{api}/containers/json")
        async def list_containers(
            api: str, all_: str = Query("0", alias="all"), filters: str | None = None
        ) -> JSONResponse:
            wanted: dict[str, list[str]] = json.loads(filters) if filters else {}
            if unknown := set(wanted) - {"label", "name", "id", "status"}:
                return JSONResponse({"message": f"invalid filter '{sorted(unknown)[0]}'"}, status_code=400)
            listed = [
                self.summary(c)
                for c in self.containers.values()
                if (all_ in ("1", "true", "True") or c["State"]["Running"]) and self.matches(c, wanted)
            ]
            return JSONResponse(listed)

        @app.get("/v{api}/containers/{ref}/json")
        async def inspect(api: str, ref: str) -> JSONResponse:
            found = self.find(ref)
            if found is None:
                return JSONResponse({"message": f"No such container: {ref}"}, status_code=404)
            return JSONResponse(found)

        @app.post("/v{api}/containers/{ref}/restart")
        async def restart(api: str, ref: str, request: Request) -> Response:
            found = self.find(ref)
            if found is None:
                return JSONResponse({"message": f"No such container: {ref}"}, status_code=404)
            self.restarts.append((found["Name"].lstrip("/"), request.query_params.get("t")))
            found["State"] = {"Status": "running", "Running": True, "Restarting": False}
            return Response(status_code=204)

        return app


def container(
    name: str, service: str | None = None, aliases: tuple[str, ...] = (), running: bool = False
) -> dict[str, Any]:
    """A container as `GET /containers/{id}/json` shows it; with `service`, one Compose made in project rlfleet."""
    state = {"Status": "running", "Running": True, "Restarting": False, "ExitCode": 0}
    if not running:
        state = {"Status": "exited", "Running": False, "Restarting": False, "ExitCode": 137}
    labels = {"com.docker.compose.project": "rlfleet", "com.docker.compose.service": service} if service else {}
    return {
        "Id": hashlib.sha256(name.encode()).hexdigest(),
        "Name": f"/{name}",
        "State": state,
        "Config": {"Image": "rlfleet/engine:0.1.0", "Labels": labels},
        "NetworkSettings": {
            "Networks": {"rlfleet_default": {"Aliases": list(aliases) or None, "NetworkID": "net-default"}}
        },
    }


def compose_engine(service: str, *extra_aliases: str, running: bool = False) -> dict[str, Any]:
    """Container 1 of a Compose service of project rlfleet: named rlfleet-<service>-1, with the network aliases
    Compose gives it (its name, its service, the service's `aliases`)."""
    name = f"rlfleet-{service}-1"
    return container(name, service=service, aliases=(name, service, *extra_aliases), running=running)


def docker_restart(docker: FakeDocker, url: str) -> str:
    server = ThreadedServer(docker.app()).start()
    try:
        restarter = DockerRestarter(
            base_url=f"tcp://127.0.0.1:{server.port}", container="{host}", stop_timeout_secs=7, timeout_secs=10
        )
        try:
            return asyncio.run(restarter.restart(url))
        finally:
            asyncio.run(restarter.close())
    finally:
        server.stop()


def test_docker_restarter_restarts_the_engines_container() -> None:
    docker = FakeDocker().add(container("engine-1"))
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


def test_a_docker_restart_the_healer_gave_up_on_is_waited_for_not_sent_again() -> None:
    """The SDK's call runs in a thread the healer's bound does not stop: each attempt after a slow restart (the
    daemon waits out the stop timeout, then kills) sent the daemon another restart of the same container while the
    earlier ones were still open, and said only "TimeoutError: "."""
    docker = FakeDocker().add(container("engine-0"))
    app = docker.app()
    in_flight: list[int] = [0, 0]  # now, most at once

    @app.middleware("http")
    async def slow_restart(request: Request, call_next: Any) -> Response:
        if not request.url.path.endswith("/restart"):
            return await call_next(request)
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await asyncio.sleep(2.5)
        in_flight[0] -= 1
        return await call_next(request)

    server = ThreadedServer(app).start()
    try:

        async def scenario() -> str:
            restarter = DockerRestarter(f"tcp://127.0.0.1:{server.port}", "{host}", 2, timeout_secs=1.0)
            workers = WorkerRegistry(1, 1)
            worker, _ = workers.add("http://engine-0:30001")
            worker.added_at -= 10
            metrics = RouterMetrics(workers, lambda: None)
            healer = Healer(
                restarter, workers, LeastLoad(), metrics, 1.0, initial_backoff_secs=0.1, max_backoff_secs=0.1
            )
            workers.on_failed = healer.on_failed
            workers.record_failure(worker, "connection refused")
            await asyncio.sleep(3.0)
            await healer.stop()
            return str(worker.last_error)

        last_error = asyncio.run(scenario())
        assert in_flight[1] == 1 and len(docker.restarts) == 1
        assert "not done within 1s (--restart-timeout-secs)" in last_error
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("containers", "restarted"),
    [
        # docker compose up (profile cpu): the engine's host is its service, container rlfleet-engine-0-1.
        (
            [compose_engine("engine-0"), compose_engine("engine-1"), compose_engine("router", running=True)],
            "rlfleet-engine-0-1",
        ),
        # Profile gpu: service engine-gpu-0 answers to engine-0 through its network alias.
        (
            [compose_engine("engine-gpu-0", "engine-0"), compose_engine("engine-gpu-1", "engine-1")],
            "rlfleet-engine-gpu-0-1",
        ),
        # A container named as the host (container_name: engine-0, `docker run --name engine-0`).
        ([container("engine-0"), compose_engine("engine-1")], "engine-0"),
    ],
    ids=["compose-service", "compose-network-alias", "exact-name"],
)
def test_docker_restarter_finds_the_container_a_compose_host_name_names(
    containers: list[dict[str, Any]], restarted: str
) -> None:
    """The engine URL's host is what the router resolves on the Compose network: a service or an alias, which
    `GET /containers/{id}/json` does not resolve. The engines there are stopped: found among all containers."""
    docker = FakeDocker().add(*containers)
    assert docker_restart(docker, "http://engine-0:30001") == "http://engine-0:30001"
    assert docker.restarts == [(restarted, "7")]


def test_a_container_answers_to_its_compose_service_and_its_network_aliases() -> None:
    labelled = container("rlfleet-engine-0-1", service="engine-0")  # on no network with aliases (never started)
    aliased = container("sglang-0", aliases=("engine-0",))  # `docker run --network-alias engine-0`
    assert answers_to(labelled, "engine-0") and answers_to(aliased, "engine-0")
    assert not answers_to(labelled, "engine-1") and not answers_to(aliased, "engine-1")
    assert not answers_to(container("engine-0"), "engine-0")  # its name: resolved by the API itself
    assert not answers_to({"Id": "x", "NetworkSettings": {"Networks": {"bridge": None}}}, "engine-0")


def test_docker_restarter_refuses_a_host_name_several_containers_answer_to() -> None:
    """Both profiles' engines left on one network: restarting either could bring back the wrong one."""
    docker = FakeDocker().add(compose_engine("engine-0"), compose_engine("engine-gpu-0", "engine-0", running=True))
    with pytest.raises(Unavailable, match=r"rlfleet-engine-0-1.*rlfleet-engine-gpu-0-1.*--docker-container"):
        docker_restart(docker, "http://engine-0:30001")
    assert docker.restarts == []


def test_docker_restarter_names_what_it_looked_for_when_no_container_answers() -> None:
    docker = FakeDocker().add(compose_engine("engine-1"))
    with pytest.raises(Unavailable, match="engine-0"):
        docker_restart(docker, "http://engine-0:30001")
    assert docker.restarts == []


@pytest.mark.parametrize("port", [":30000", ""])  # "": the scheme's default, which the fleet leaves out of a URL
def test_kubernetes_restarter_deletes_the_pod_and_returns_its_replacement(port: str) -> None:
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    server = ThreadedServer(kube.app()).start()
    try:

        async def scenario() -> str:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            restarter = KubernetesRestarter(api, SELECTOR, timeout_secs=10, poll_secs=0.05)
            try:
                return await restarter.restart(f"http://10.0.0.2{port}")
            finally:
                await restarter.close()

        new_url = asyncio.run(scenario())
        assert kube.deleted == ["engine-b"]
        replacement = next(p for n, p in kube.pods.items() if n not in ("engine-a",))
        assert new_url == f"http://{replacement['status']['podIP']}{port}"
    finally:
        server.stop()


def test_kubernetes_restarter_waits_for_a_replacement_under_way_rather_than_delete_it() -> None:
    """A StatefulSet recreates a deleted pod (a node drain, a rolling update) under its name: the pod found when
    the engine fails is then often that replacement, still loading the model, which was deleted and started over."""
    kube = FakeKubernetes(stateful=True)
    kube.add_pod("engine-0", "10.0.0.1", ready=False, age_secs=2)
    server = ThreadedServer(kube.app()).start()
    url = "http://engine-0.engines.rl.svc:30000"
    try:

        async def scenario() -> str:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            restarter = KubernetesRestarter(api, SELECTOR, timeout_secs=10, poll_secs=0.05)
            try:
                return await restarter.restart(url)
            finally:
                await restarter.close()

        assert asyncio.run(scenario()) == url
        assert kube.deleted == [], "the replacement was left to become Ready"
    finally:
        server.stop()


def test_a_pod_is_deleted_only_while_it_is_the_pod_the_restarter_found() -> None:
    """The delete names the pod's uid: one replaced between the restarter's list and its delete is left alone."""
    kube = FakeKubernetes(stateful=True)
    kube.add_pod("engine-0", "10.0.0.1")
    server = ThreadedServer(kube.app()).start()
    try:

        async def scenario() -> None:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            try:
                await api.delete_pod("engine-0", "uid-of-the-pod-before")
            finally:
                await api.close()

        asyncio.run(scenario())
        assert kube.deleted == [] and kube.pods["engine-0"]["metadata"]["uid"] == "uid-0"
    finally:
        server.stop()


def test_in_cluster_the_api_of_an_ipv6_cluster_is_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its service host is a bare IPv6 address: https://fd00:10:96::1:6443 was no URL, and the router did not start."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00:10:96::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    api = KubernetesAPI.from_config(RouterConfig(kubernetes_namespace="rl"))
    try:
        assert str(api._client.base_url) == "https://[fd00:10:96::1]:6443"
    finally:
        asyncio.run(api.close())


def test_kubernetes_restarts_of_two_engines_by_ip_at_once_take_one_new_pod_each() -> None:
    """Any new Ready pod of the selector replaces an engine known by IP: two restarts at once both took the first
    one Ready, leaving two workers at one URL and the other replacement pod unused."""
    kube = FakeKubernetes()
    kube.add_pod("engine-a", "10.0.0.1")
    kube.add_pod("engine-b", "10.0.0.2")
    server = ThreadedServer(kube.app()).start()
    try:

        async def scenario() -> list[str]:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            restarter = KubernetesRestarter(api, SELECTOR, timeout_secs=10, poll_secs=0.05)
            try:
                return list(
                    await asyncio.gather(
                        restarter.restart("http://10.0.0.1:30000"), restarter.restart("http://10.0.0.2:30000")
                    )
                )
            finally:
                await restarter.close()

        urls = asyncio.run(scenario())
        assert sorted(kube.deleted) == ["engine-a", "engine-b"]
        replacements = {f"http://{p['status']['podIP']}:30000" for p in kube.pods.values()}
        assert len(set(urls)) == 2 and set(urls) == replacements
    finally:
        server.stop()


def test_the_local_restarter_stops_what_it_started_for_an_engine_that_left_the_fleet(tmp_path: Path) -> None:
    """A restart is cancelled when its engine is removed from the fleet; the process it started must not run on,
    unknown to the fleet, until the router stops."""
    command = f"{sys.executable} -c 'import time; time.sleep(60)' {{host}} {{port}}"
    restarter = LocalRestarter(command, 1, "127.0.0.1", tmp_path, timeout_secs=10, stop_timeout_secs=2)

    async def scenario() -> int:
        [url] = await restarter.start()
        first = restarter.pid(url)
        assert await restarter.restart(url) == url
        restarted = restarter.pid(url)
        assert restarted is not None and restarted != first
        await restarter.release(url)
        assert restarter.pid(url) is None
        await restarter.close()
        return restarted

    restarted = asyncio.run(scenario())
    assert not process_runs(restarted)


def test_an_engine_removed_from_the_fleet_outside_a_restart_has_its_process_stopped(tmp_path: Path) -> None:
    """An engine the local restarter started (at the router's start, or by a restart long done) and then removed
    from the fleet (DELETE /workers, to scale down): its process ran on, serving no one, until the router stopped."""
    command = f"{sys.executable} -c 'import time; time.sleep(60)' {{host}} {{port}}"
    restarter = LocalRestarter(command, 2, "127.0.0.1", tmp_path, timeout_secs=10, stop_timeout_secs=2)

    async def scenario() -> tuple[int | None, bool, bool]:
        kept_url, removed_url = await restarter.start()
        kept, removed = restarter.pid(kept_url), restarter.pid(removed_url)
        workers = WorkerRegistry(1, 1)
        workers.add(kept_url)
        worker, _ = workers.add(removed_url)
        healer = Healer(restarter, workers, LeastLoad(), RouterMetrics(workers, lambda: None), 10.0, 10.0, 10.0)
        try:
            workers.remove(worker.id)  # as Fleet.remove_worker does
            healer.forget(worker)
            deadline = time.monotonic() + 10.0
            while removed is not None and process_runs(removed) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return kept, removed is not None and not process_runs(removed), kept is not None and process_runs(kept)
        finally:
            await healer.stop()

    kept, removed_stopped, kept_ran = asyncio.run(scenario())
    assert removed_stopped, "the removed engine's process ran on after it left the fleet"
    assert kept_ran, "the engine still in the fleet was stopped too"
    assert kept is not None and not process_runs(kept), "the router's shutdown stops what its restarter started"


def test_the_local_restarter_releases_only_the_process_at_the_url_s_own_host(tmp_path: Path) -> None:
    """Processes were known by port alone: releasing an engine elsewhere at the same port (an adopted one on
    another host, removed from the fleet) stopped the local engine at that port."""
    command = f"{sys.executable} -c 'import time; time.sleep(60)' {{host}} {{port}}"
    restarter = LocalRestarter(command, 1, "127.0.0.1", tmp_path, timeout_secs=10, stop_timeout_secs=2)

    async def scenario() -> tuple[int | None, int | None]:
        [url] = await restarter.start()
        before = restarter.pid(url)
        await restarter.release(url.replace("127.0.0.1", "10.0.0.7"))
        after = restarter.pid(url)
        await restarter.close()
        return before, after

    before, after = asyncio.run(scenario())
    assert before is not None and after == before


class SlowStarts(LocalRestarter):
    """A LocalRestarter whose process starts wait for `gate` once it is cleared, as a fork and exec on a busy machine
    takes its time; `starting` is set when one waits."""

    def __init__(self, command: str, log_dir: Path) -> None:
        super().__init__(command, 1, "127.0.0.1", log_dir, timeout_secs=10, stop_timeout_secs=2)
        self.gate = threading.Event()
        self.gate.set()
        self.starting = threading.Event()

    def _spawn(self, host: str, port: int) -> None:
        if not self.gate.is_set():
            self.starting.set()
            assert self.gate.wait(10.0), "the test never let the start go on"
        super()._spawn(host, port)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_engine_added_again_while_its_removed_predecessor_restarts_keeps_the_process_started_there(
    tmp_path: Path,
) -> None:
    """An engine removed while its restart starts the new process (DELETE /workers, discovery dropping it) and added
    again at once at its URL: the cancelled restart's cleanup stopped the process the new worker was using, left
    without an engine until its own failures added up to a restart (the restart timeout, for a new engine)."""
    restarter = SlowStarts(f"{sys.executable} -m http.server --bind {{host}} {{port}}", tmp_path)

    async def scenario() -> tuple[int | None, int | None, bool]:
        [url] = await restarter.start()
        first = restarter.pid(url)
        workers = WorkerRegistry(1, 1)
        removed, _ = workers.add(url)
        removed.added_at -= 60  # not a new engine still given the restart timeout to come up
        healer = Healer(restarter, workers, LeastLoad(), RouterMetrics(workers, lambda: None), 10.0, 10.0, 10.0)
        workers.on_failed = healer.on_failed
        try:
            restarter.gate.clear()
            workers.record_failure(removed, "connection refused")
            assert await asyncio.to_thread(restarter.starting.wait, 10.0), "the restart never started a process"
            workers.remove(removed.id)  # as Fleet.remove_worker does
            healer.forget(removed)
            workers.add(url)
            restarter.gate.set()
            deadline = time.monotonic() + 10.0
            while not await asyncio.to_thread(answers, url) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the cancelled restart's cleanup has run by now
            return first, restarter.pid(url), await asyncio.to_thread(answers, url)
        finally:
            await healer.stop()

    first, serving, answered = asyncio.run(scenario())
    assert serving is not None and serving != first, "the process the restart started was stopped"
    assert answered, "nothing serves the URL of the worker added again"
    assert not process_runs(serving), "the router's shutdown stops what its restarter started"


def test_the_local_restarter_waits_for_a_hung_engines_port_without_stopping_the_event_loop(tmp_path: Path) -> None:
    """An adopted engine that hangs still holds its port; once its accept queue is full, a connect there is left
    unanswered until its timeout. Before, that connect ran on the event loop (the router relayed nothing for a
    second) and its timeout read as a free port: an engine was started on a port it could not listen on."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(0)  # one connection fills its queue; it never accepts
    port = hung.getsockname()[1]
    queued = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    command = f"{sys.executable} -c 'import time; time.sleep(60)' {{host}} {{port}}"
    restarter = LocalRestarter(command, 0, "127.0.0.1", tmp_path, timeout_secs=1.5, stop_timeout_secs=2)

    async def scenario() -> tuple[BaseException | str, float]:
        longest = 0.0

        async def tick() -> None:
            nonlocal longest
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.02)
                longest = max(longest, time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        try:
            outcome: BaseException | str = await restarter.restart(f"http://127.0.0.1:{port}")
        except Unavailable as exc:
            outcome = exc
        finally:
            await asyncio.sleep(0.05)  # the ticker measures a stall once it runs again
            ticker.cancel()
            await restarter.close()
        return outcome, longest

    try:
        outcome, longest = asyncio.run(scenario())
    finally:
        queued.close()
        hung.close()
    assert isinstance(outcome, Unavailable) and f"port {port} is still in use" in str(outcome), outcome
    assert longest < 0.5, f"the event loop stood still for {longest:.2f}s"


def test_a_kubernetes_api_call_is_bounded_whole_not_per_read() -> None:
    """httpx bounds each read: an answer trickling in a byte at a time, each within the bound, held a restart or a
    discovery round for as long as it trickled."""
    app = FastAPI()

    @app.get("/api/v1/namespaces/engines/pods")
    async def pods() -> StreamingResponse:
        async def trickle() -> AsyncIterator[bytes]:
            for _ in range(100):  # 10 s in all
                yield b" "
                await asyncio.sleep(0.1)

        return StreamingResponse(trickle(), media_type="application/json")

    server = ThreadedServer(app).start()

    async def call() -> float:
        api = KubernetesAPI(server.url, "engines", None, None, timeout_secs=0.5)
        started = time.monotonic()
        try:
            with pytest.raises(Unavailable, match="ReadTimeout"):
                await api.list_pods(SELECTOR)
            return time.monotonic() - started
        finally:
            await api.close()

    try:
        took = asyncio.run(call())
    finally:
        server.stop()
    assert took < 3.0, f"the call took {took:.1f}s"


def test_a_kubernetes_answer_cut_short_fails_a_restart_as_unavailable_logged_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 200 whose JSON body was cut short used to raise a JSONDecodeError out of the API client, which the healer
    logged with a traceback as an unexpected error; it is the API being unavailable, as any failed call is."""
    app = FastAPI()

    @app.get("/api/v1/namespaces/engines/pods")
    async def cut_short() -> Response:
        return Response(b'{"kind": "PodList", "items": [{"metadata": {"na', media_type="application/json")

    server = ThreadedServer(app).start()

    async def scenario() -> str | None:
        api = KubernetesAPI(server.url, "engines", None, None, timeout_secs=5)
        restarter = KubernetesRestarter(api, SELECTOR, timeout_secs=5, poll_secs=0.05)
        workers = WorkerRegistry(1, 1)
        worker, _ = workers.add("http://10.0.0.1:30000")
        worker.added_at -= 10  # not a new engine still given the restart timeout to come up
        healer = Healer(restarter, workers, LeastLoad(), RouterMetrics(workers, lambda: None), 5.0, 10.0, 10.0)
        workers.on_failed = healer.on_failed
        workers.record_failure(worker, "connection refused")
        async with asyncio.timeout(5):
            while worker.last_error == "connection refused":
                await asyncio.sleep(0.02)
        await healer.stop()
        return worker.last_error

    try:
        with caplog.at_level(logging.WARNING, logger="rlfleet_router.self_healing"):
            last_error = asyncio.run(scenario())
    finally:
        server.stop()
    assert last_error is not None and last_error.startswith("restart failed: Unavailable: Kubernetes API GET "), (
        last_error
    )
    assert f"{server.url}/api/v1/namespaces/engines/pods?labelSelector=" in last_error, last_error
    assert "HTTP 200 but not JSON" in last_error and '"items": [{"metadata": {"na' in last_error, last_error
    [failed] = [r for r in caplog.records if r.getMessage().startswith("restart of ")]
    assert not failed.exc_info, "logged with a traceback"


def test_kubernetes_restarter_keeps_a_statefulset_engine_at_its_dns_name() -> None:
    """The Helm chart lists engines by their StatefulSet DNS names: the pod is found by name, and its
    replacement, the same name on a new IP, serves the same URL."""
    kube = FakeKubernetes(stateful=True)
    kube.add_pod("rl-engine-0", "10.0.0.1")
    kube.add_pod("rl-engine-1", "10.0.0.2")
    server = ThreadedServer(kube.app()).start()
    url = "http://rl-engine-1.rl-engine.rl.svc:30000"
    try:

        async def scenario() -> tuple[str, str]:
            api = KubernetesAPI(server.url, "rl", None, None, timeout_secs=5)
            restarter = KubernetesRestarter(api, SELECTOR, timeout_secs=10, poll_secs=0.05)
            try:
                new_url = await restarter.restart(url)
                with pytest.raises(Unavailable, match="is named 'rl-engine-7' as the host of"):
                    await restarter.restart("http://rl-engine-7.rl-engine.rl.svc:30000")
                return new_url, str(kube.pods["rl-engine-1"]["status"]["podIP"])
            finally:
                await restarter.close()

        new_url, new_ip = asyncio.run(scenario())
        assert kube.deleted == ["rl-engine-1"]
        assert new_url == url
        assert new_ip != "10.0.0.2", "the fake's StatefulSet recreated the pod on a new IP"
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
